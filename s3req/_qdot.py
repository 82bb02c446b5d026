"""The quantized matmul `qdot` (DESIGN.md section 3) and the gradient quantizer it uses."""

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int8, PRNGKeyArray, Shaped

from ._backward import (
    Dense,
    gradient_checks,
    gradient_max,
    MAX_TERMS,
    passed,
    quantize,
    quantized_matmul,
)
from ._formats import IntGrad
from ._interfaces import AbstractPolicy
from ._quantize import gradient_step
from ._sharding import NO_AXES, on_auto_axes, ShardAxes
from ._thresholds import Layout


def quantize_gradient(
    policy: AbstractPolicy,
    y: Float[Array, "..."],
    key: PRNGKeyArray | None,
    block: Layout,
) -> tuple[Shaped[Array, "..."], Shaped[Array, "..."]]:
    """The codes of the scaled gradient `y` for the dX and the dW GEMM.

    `y` is already in units of the format's grid: `G'/delta` for integer formats (int8 codes),
    `G'` divided by its block scales for block-float formats (float32 grid values). It is a
    `(b, s, d)` block of the dense gradient described by a [`s3req.Block`][], or the `(n, d)`
    expert-sorted rows described by a [`s3req.Rows`][].

    For topologies that quantize once both are the same array (one int8 tensor feeds both
    GEMMs); otherwise they are rounded with two independent threshold tensors.
    """
    topology, fmt = policy.topology, policy.fmt
    if topology.quantizes_once():
        q = fmt.round(y, topology.thresholds(key, block, "dx"))
        return q, q
    assert key is not None
    kx, kw = jr.split(key)
    return (
        fmt.round(y, topology.thresholds(kx, block, "dx")),
        fmt.round(y, topology.thresholds(kw, block, "dw")),
    )


def gradient_codes(
    policy: AbstractPolicy,
    gp: Float[Array, "b s d"],
    key: PRNGKeyArray | None,
    axes: ShardAxes | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""], Int8[Array, "b s d"], Int8[Array, "b s d"]]:
    """Quantize the scale-folded gradient `G'` as the backward pass of `qdot` does.

    One per-tensor step `delta = max|G'| / qmax` over the whole logical tensor (a `pmax` over
    the sharded axes inside `shard_map`), then the int8 codes for the dX and the dW GEMM with
    the thresholds of the policy's topology for this block of `G'`.

    **Arguments:**

    - `policy`: the rounding policy (an integer gradient format).
    - `gp`: `G' = s_x G s_w`, float32, `(b, s, d)` (a shard's block inside `shard_map`).
    - `key`: the key of this backward pass (as given to `qdot`).
    - `axes`: the mesh axes sharding `gp` inside `shard_map` (`None`: unsharded or `jit`).

    **Returns:**

    `(delta, inv, q_dx, q_dw)`; `q_dx is q_dw` for policies that quantize once. `delta`
    raises at run time where `G'` holds a NaN or an Inf, or is so small that `delta` is below
    float32's range (the checks of `qdot`'s backward).
    """
    ax = NO_AXES if axes is None else axes
    fmt = policy.fmt
    if not isinstance(fmt, IntGrad):
        raise TypeError(f"gradient_codes: integer gradient formats only, got {fmt}.")
    amax = gradient_max(gp, ax)
    amax = amax * passed(gradient_checks(amax, "s3req.gradient_codes"), ax, amax.dtype)
    (q_dx, delta), (q_dw, _) = quantize(policy, gp, amax, key, ax.block(gp.shape))  # pyright: ignore
    _, inv = gradient_step(amax, fmt.qmax)
    return delta, inv, q_dx, q_dw


_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_key(name: str, key) -> None:
    """A `TypeError` naming the fix unless `key` is `None` or a JAX key array (a typed
    `jax.random.key` or a raw uint32 `jax.random.PRNGKey`), and a `ValueError` for a batch of
    keys (raised while tracing the forward, for every topology)."""
    if key is None:
        return
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32
    if not (typed or raw):
        raise TypeError(
            f"{name}: `key` must be a JAX PRNG key, got {type(key).__name__} {key!r:.40}. Use "
            "`jax.random.key(seed)` and split it for every call (`jax.random.split`)."
        )
    if key.shape != (() if typed else (2,)):
        raise ValueError(
            f"{name}: needs a single Threefry key, got a key array of shape {key.shape}. Use "
            "`jax.random.key(seed)` and split it per call, not a batch of keys."
        )


def _check(x: Array, w: Array, policy: AbstractPolicy | None, key, transposed: bool) -> None:
    check_key("s3req.qdot", key)
    layout = "(d_out, d_in)" if transposed else "(d_in, d_out)"
    d_in = w.shape[1 if transposed else 0] if w.ndim == 2 else None
    for name, arr in (("x", x), ("w", w)):
        if not any(arr.dtype == d for d in _FLOATS):
            raise TypeError(
                f"s3req.qdot: `{name}` must be float32, bfloat16 or float16, got {arr.dtype}."
            )
    if w.ndim != 2:
        raise ValueError(f"s3req.qdot: `w` must have shape {layout}, got {w.shape}.")
    if not 1 <= x.ndim <= 3:
        raise ValueError(
            "s3req.qdot: `x` must have shape (batch, seq, d_in), (seq, d_in) or (d_in,), got "
            f"{x.shape}. Fold extra leading axes into batch or seq, or use jax.vmap."
        )
    if x.shape[-1] != d_in:
        raise ValueError(
            f"s3req.qdot: x has {x.shape[-1]} input features but w expects {d_in} "
            f"(x: {x.shape}, w: {w.shape})."
        )
    if any(n == 0 for n in x.shape + w.shape):
        raise ValueError(f"s3req.qdot: empty operand (x: {x.shape}, w: {w.shape}).")
    if policy is not None:
        if max(w.shape) > MAX_TERMS:
            raise ValueError(
                f"s3req.qdot: feature dimensions above {MAX_TERMS} would overflow int32 "
                f"accumulation, got w of shape {w.shape}."
            )
        if policy.stochastic and key is None:
            raise ValueError(
                f"s3req.qdot: policy {policy} rounds stochastically and needs a fresh "
                "`key=` for every call (e.g. split the step key per layer)."
            )


def qdot(
    x: Float[Array, "*batch d_in"],
    w: Float[Array, "d_in d_out"],
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    axes: ShardAxes | None = None,
) -> Float[Array, "*batch d_out"]:
    """Quantized `x @ w` with an INT8 forward and an INT8 backward (DESIGN.md section 3).

    Forward: per-token scales for `x`, per-output-channel scales for `w`, round to nearest even,
    int8 x int8 GEMM with int32 accumulation, rescale. Only the int8 operands and the scales
    are saved for the backward pass.

    Backward: both scales are folded into the upstream gradient, which is rounded with one
    per-tensor step and the thresholds of `policy.topology`; for every topology except
    `Independent()` one int8 gradient feeds both the dX and the dW GEMM. `policy.correction`
    then subtracts the structured part of the known rounding error (S3R-EC).

    **Arguments:**

    - `x`: activations `(batch, seq, d_in)`; `(seq, d_in)` is one example and `(d_in,)` one
      token. float32, bfloat16 or float16.
    - `w`: weights `(d_in, d_out)`.
    - `policy`: a rounding policy, e.g. `Policy(Phi2D(), TwoWayEC())`, or `None` for a plain
      float matmul (`w` is cast to the dtype of `x`).
    - `key`: a fresh PRNG key for the backward thresholds. Keyword only; required when the
      policy is stochastic.
    - `axes`: inside `jax.shard_map`, the mesh axes that shard the operands (a
      [`s3req.ShardAxes`][]); `None` under `jax.jit` sharding or unsharded. Keyword only.
      On a mesh of `AxisType.Explicit` axes the maths runs with those axes `Auto` and the
      product is sharded as `x @ w` would be (docs/guides/scaling.md).

    **Returns:**

    `x @ w` with the leading shape of `x` and the dtype of `x`.

    Non-finite values in `x`, `w` or the upstream gradient raise an error (under `jax.jit`, an
    `equinox` runtime error).
    """
    return qdot_t(x, w, policy=policy, key=key, axes=axes, transposed=False)


def qdot_t(
    x: Float[Array, "*batch d_in"],
    w: Float[Array, "n m"],
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    axes: ShardAxes | None = None,
    transposed: bool = True,
) -> Float[Array, "*batch d_out"]:
    """`qdot` for a weight stored `(d_out, d_in)` (as in `equinox.nn.Linear` and
    [`s3req.QuantLinear`][]) when `transposed=True`: `x @ w.T`, and its weight gradient in the
    same layout.

    The same computation as `qdot(x, w.T, ...)`, with every reduction, quantization and GEMM
    reading `w` in its own layout: XLA CPU would otherwise copy the float weight into the
    transposed layout (or quantize it with strided reads) on every call. `transposed=False` is
    `qdot` itself.
    """
    _check(x, w, policy, key, transposed)
    if policy is None:
        y = jnp.matmul(x, (w.T if transposed else w).astype(x.dtype))
        return y if axes is None else axes.psum(y, "d_in")
    layer = Dense(axes=NO_AXES if axes is None else axes, transposed=transposed)
    h_all = w.shape[1 if transposed else 0] * layer.axes.size("d_in")
    d_all = w.shape[0 if transposed else 1] * layer.axes.size("d_out")
    if max(h_all, d_all) > MAX_TERMS:
        raise ValueError(
            f"s3req.qdot: feature dimensions above {MAX_TERMS} would overflow int32 "
            f"accumulation, got a global weight of shape {(h_all, d_all)}."
        )

    def product(x, w, key):
        x3 = x.reshape((1,) * (3 - x.ndim) + x.shape)
        y: Array = quantized_matmul(policy, layer, x3, w, key)  # pyright: ignore
        return y.reshape(x.shape[:-1] + (d_all // layer.axes.size("d_out"),))

    def plain(x, w, key):
        return jnp.matmul(x, (w.T if transposed else w).astype(x.dtype))

    return on_auto_axes("s3req.qdot", product, plain, x, w, key)
