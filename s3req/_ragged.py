"""`qragged_dot`: the quantized expert (ragged) matmul of mixture-of-experts layers.

The same maths as [`s3req.qdot`][] (DESIGN.md section 3) on expert-sorted rows: the rows of
`x` are grouped by expert (`group_sizes`), expert `e` multiplies its rows by its own weight
`w[e]`. Thresholds are keyed by the global `(token, slot)` id of every row (a
[`s3req.Rows`][] layout), never by its sorted position, and the error correction runs over
`(example, expert)` segments instead of examples.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8, PRNGKeyArray

from ._formats import IntGrad
from ._interfaces import AbstractPolicy
from ._qdot import check_key, DW_CHUNK, first_order_only, MAX_TERMS, quantize_gradient
from ._quantize import absmax_scale, gradient_step, QMAX, round_to_int8
from ._thresholds import Rows


_F32 = jnp.float32
_I32 = jnp.int32


def _rdot(lhs: Array, rhs: Array, group_sizes: Array, lhs_contract: int, rhs_contract: int):
    """Ragged dot, rows of `lhs` grouped: `(n, k) x (E, ..k..) -> (n, m)`, int32 if int8."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((lhs_contract,), (rhs_contract,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    pref = _I32 if lhs.dtype == jnp.int8 else None
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dn, preferred_element_type=pref)


def _rdot_rows(a: Array, b: Array, group_sizes: Array) -> Array:
    """`a[rows of e]^T b[rows of e]` for every expert: `(n, h), (n, d) -> (E, h, d)` int32."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(a, b, group_sizes, dn, preferred_element_type=_I32)


def _ragged_token_contraction(
    xq: Int8[Array, "n h"], q: Int8[Array, "n d"], group_sizes: Int[Array, " e"]
) -> Float[Array, "e h d"]:
    """`Xq_e^T Q_e` for every expert without int32 overflow (as `qdot`'s dW contraction).

    Up to `MAX_TERMS` rows this is one int8 ragged GEMM with int32 accumulation. Beyond, the
    rows are cut into chunks of `DW_CHUNK` (each expert's group clipped to the chunk), every
    chunk's int32 partial is split into high and low 16-bit parts summed exactly in int32,
    and the result is `hi * 2**16 + lo` rounded once to float32.
    """
    n = xq.shape[0]
    if n <= MAX_TERMS:
        return _rdot_rows(xq, q, group_sizes).astype(_F32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    his, los = [], []
    for lo_row in range(0, n, DW_CHUNK):
        hi_row = min(lo_row + DW_CHUNK, n)
        sizes = jnp.clip(jnp.minimum(ends, hi_row) - jnp.maximum(starts, lo_row), 0)
        part = _rdot_rows(xq[lo_row:hi_row], q[lo_row:hi_row], sizes.astype(group_sizes.dtype))
        his.append(part >> 16)
        los.append(part & 0xFFFF)
    hi = jnp.sum(jnp.stack(his), axis=0)  # exact in int32: few chunks of 16-bit parts
    lo = jnp.sum(jnp.stack(los), axis=0)
    return hi.astype(_F32) * 65536.0 + lo.astype(_F32)


def _segment_error_stats(q: Array, y: Array, segment: Array, num_segments: int):
    """Per-row means `eps[r]` and per-segment channel means `a[g]` and grand means `m[g]` of
    the rounding error `q - y` (in steps): `s3req.error_stats` with "example" replaced by
    "(example, expert) segment". Empty segments get zeros."""
    e = q.astype(_F32) - y
    eps = jnp.mean(e, axis=1)  # (n,)
    count = jax.ops.segment_sum(jnp.ones_like(eps), segment, num_segments)
    safe = jnp.maximum(count, 1.0)
    a = jax.ops.segment_sum(e, segment, num_segments) / safe[:, None]  # (G, D)
    m = jax.ops.segment_sum(eps, segment, num_segments) / safe  # (G,)
    return eps, a, m


def _expert_of_row(group_sizes: Array, n: int) -> Array:
    E = group_sizes.shape[0]
    return jnp.repeat(jnp.arange(E, dtype=_I32), group_sizes, total_repeat_length=n)


def _forward(policy: AbstractPolicy, num_examples: int, x, w, group_sizes, example_id):
    n = x.shape[0]
    E = w.shape[0]
    sx = absmax_scale(x, axis=-1)  # (n, 1)
    sw = absmax_scale(w, axis=1)[:, 0, :]  # (E, D): per expert, per output channel
    sx = eqx.error_if(sx, ~jnp.all(jnp.isfinite(sx)), "s3req.qragged_dot: x contains NaN or Inf.")
    sw = eqx.error_if(sw, ~jnp.all(jnp.isfinite(sw)), "s3req.qragged_dot: w contains NaN or Inf.")
    xq = round_to_int8(x, sx)
    wq = round_to_int8(w, sw[:, None, :])
    expert = _expert_of_row(group_sizes, n)
    acc = _rdot(xq, wq, group_sizes, 1, 1)  # (n, D) int32
    y = (acc.astype(_F32) * sx * sw[expert]).astype(x.dtype)
    ec = policy.correction
    xsum = rw = None
    if ec.dw:  # (B*E, H): the int8 row sums of every (example, expert) segment
        segment = example_id * E + expert
        xsum = jax.ops.segment_sum(xq.astype(_I32), segment, num_examples * E)
    if ec.dx_token:  # (E, H): Wq_e 1_D
        rw = jnp.sum(wq, axis=2, dtype=_I32)
    return y, (xq, wq, sx, sw, expert, xsum, rw)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qragged(policy, num_examples, x, w, group_sizes, key, row_id, example_id):
    return _forward(policy, num_examples, x, w, group_sizes, example_id)[0]


def _qragged_fwd(policy, num_examples, x, w, group_sizes, key, row_id, example_id):
    y, res = _forward(policy, num_examples, x, w, group_sizes, example_id)
    like = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return y, (res, group_sizes, key, row_id, example_id, like)


def _qragged_bwd(policy: AbstractPolicy, num_examples: int, residuals, g):
    (xq, wq, sx, sw, expert, xsum, rw), group_sizes, key, row_id, example_id, like = residuals
    g, sx, sw = first_order_only("s3req.qragged_dot", (g, sx, sw))
    n, D = g.shape
    E, H, _ = wq.shape
    # Fold both scales into the gradient, one per-tensor step (float32 even for bf16 G).
    gp = sx * g.astype(_F32) * sw[expert]
    delta, inv = gradient_step(gp)
    delta = eqx.error_if(
        delta,
        ~jnp.isfinite(delta),
        "s3req.qragged_dot: the upstream gradient contains NaN or Inf (check the loss and the "
        "layers above this one).",
    )
    y = jnp.clip(gp * inv, -QMAX, QMAX)
    q_dx, q_dw = quantize_gradient(policy, y, key, Rows(row_id, example_id, D))

    dx = _rdot(q_dx, wq, group_sizes, 1, 2).astype(_F32)  # (n, H): Q_e Wq_e^T
    dw = _ragged_token_contraction(xq, q_dw, group_sizes)  # (E, H, D)

    ec = policy.correction
    G = num_examples * E
    segment = example_id * E + expert  # the (example, expert) segment of every row
    if ec.dx_token:
        eps = jnp.mean(q_dx.astype(_F32) - y, axis=1)  # (n,): mean error of every row
        dx = dx - eps[:, None] * rw.astype(_F32)[expert]
    if ec.dx_channel:
        _, a, m = _segment_error_stats(q_dx, y, segment, G)
        am = (a - m[:, None]).reshape(num_examples, E, D)
        per_segment = jnp.einsum("bed,ehd->beh", am, wq.astype(_F32)).reshape(G, H)
        dx = dx - per_segment[segment]
    if ec.dw:
        eps, a, m = _segment_error_stats(q_dw, y, segment, G)
        am = (a - m[:, None]).reshape(num_examples, E, D)
        xs = xsum.astype(_F32).reshape(num_examples, E, H)
        channel_term = jnp.einsum("beh,bed->ehd", xs, am)
        token_term = jax.ops.segment_sum(xq.astype(_F32) * eps[:, None], expert, E)  # (E, H)
        dw = dw - channel_term - token_term[:, :, None]

    dx = (delta * dx / sx).astype(like[0].dtype)
    dw = (delta * dw / sw[:, None, :]).astype(like[1].dtype)
    return dx, dw, None, None, None, None


_qragged.defvjp(_qragged_fwd, _qragged_bwd)


_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check(x, w, group_sizes, policy, key, row_id, example_id, num_examples) -> None:
    name = "s3req.qragged_dot"
    check_key(name, key)
    if policy is not None and policy.fmt != IntGrad(8):
        raise NotImplementedError(
            f"{name}: the expert GEMMs support the int8 gradient format only, got "
            f"{policy.fmt.describe()}; use the format on the dense layers (qdot)."
        )
    for arg, arr in (("x", x), ("w", w)):
        if not any(arr.dtype == d for d in _FLOATS):
            raise TypeError(
                f"{name}: `{arg}` must be float32, bfloat16 or float16, got {arr.dtype}."
            )
    if x.ndim != 2:
        raise ValueError(f"{name}: `x` must have shape (rows, d_in), got {x.shape}.")
    if w.ndim != 3:
        raise ValueError(f"{name}: `w` must have shape (n_experts, d_in, d_out), got {w.shape}.")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"{name}: x has {x.shape[1]} input features but w expects {w.shape[1]} "
            f"(x: {x.shape}, w: {w.shape})."
        )
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"{name}: `group_sizes` must be integer with shape (n_experts,) = ({w.shape[0]},), "
            f"got {group_sizes.dtype}{list(group_sizes.shape)}."
        )
    if policy is None:
        return
    if max(w.shape[1:]) > MAX_TERMS:
        raise ValueError(
            f"{name}: feature dimensions above {MAX_TERMS} would overflow int32 accumulation, "
            f"got w of shape {w.shape}."
        )
    if policy.stochastic:
        if key is None:
            raise ValueError(
                f"{name}: policy {policy} rounds stochastically and needs a fresh `key=` for "
                "every call (e.g. split the step key per layer)."
            )
        if row_id is None or example_id is None:
            raise ValueError(
                f"{name}: policy {policy} rounds stochastically: pass `row_id` (the global "
                "(token, slot) id of every row, e.g. token * top_k + slot) and `example_id` "
                "(the batch index of every row), so thresholds do not depend on the order."
            )
    for arg, ids in (("row_id", row_id), ("example_id", example_id)):
        if ids is not None and (
            ids.shape != (x.shape[0],) or not jnp.issubdtype(ids.dtype, jnp.integer)
        ):
            raise ValueError(
                f"{name}: `{arg}` must be integer with shape (rows,) = ({x.shape[0]},), got "
                f"{ids.dtype}{list(ids.shape)}."
            )
    ec = policy.correction
    if (ec.dx_channel or ec.dw) and (num_examples is None or num_examples < 1):
        raise ValueError(
            f"{name}: the correction {ec} averages over (example, expert) segments: pass "
            "`num_examples` (the batch size; every example_id must lie in [0, num_examples))."
        )


def qragged_dot(
    x: Float[Array, "n d_in"],
    w: Float[Array, "n_experts d_in d_out"],
    group_sizes: Int[Array, " n_experts"],
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    row_id: Int[Array, " n"] | None = None,
    example_id: Int[Array, " n"] | None = None,
    num_examples: int | None = None,
) -> Float[Array, "n d_out"]:
    """Quantized expert matmul: rows `group_sizes[e]` of `x` (sorted by expert) times `w[e]`.

    Forward: per-row scales for `x`, per-expert per-output-channel scales for `w`, round to
    nearest even, one int8 `jax.lax.ragged_dot` with int32 accumulation, rescale.

    Backward, as [`s3req.qdot`][]: both scales are folded into the upstream gradient, which is
    rounded once with one per-tensor step and the thresholds of `policy.topology`, keyed by
    `row_id` (the global `(token, slot)` id, so they do not depend on the routing order or on
    sharding). One int8 gradient feeds both ragged GEMMs (dX: `Q_e Wq_e^T`; dW: the rows of
    each group contracted with `ragged_dot_general`). `policy.correction` subtracts the
    structured rounding error with `(example, expert)` segments in place of examples.

    **Arguments:**

    - `x`: `(n, d_in)` rows sorted by expert.
    - `w`: `(n_experts, d_in, d_out)` expert weights.
    - `group_sizes`: rows of every expert, summing to `n`.
    - `policy`: a rounding policy, or `None` for a plain float `jax.lax.ragged_dot`.
    - `key`: a fresh key for the backward thresholds; required when the policy is stochastic.
    - `row_id`: global id of every row (e.g. `token * top_k + slot`); required when the policy
      is stochastic.
    - `example_id`: batch index of every row; required when the policy is stochastic.
    - `num_examples`: number of examples (`example_id < num_examples`); required by the
      two-way and dW corrections, which average over `(example, expert)` segments.

    (All but `x`, `w`, `group_sizes` are keyword only.)

    **Returns:**

    `(n, d_out)` in the dtype of `x`.

    `group_sizes` that do not sum to `n` or are negative, and non-finite `x`, `w` or upstream
    gradients raise an error (under `jax.jit`, an `equinox` runtime error).
    """
    _check(x, w, group_sizes, policy, key, row_id, example_id, num_examples)
    n = x.shape[0]
    x = eqx.error_if(
        x,
        (jnp.sum(group_sizes) != n) | jnp.any(group_sizes < 0),
        f"s3req.qragged_dot: group_sizes must be non-negative and sum to the {n} rows of x.",
    )
    group_sizes = group_sizes.astype(_I32)
    if policy is None:
        return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
    zeros = jnp.zeros((n,), _I32)
    row_id = zeros if row_id is None else row_id.astype(_I32)
    example_id = zeros if example_id is None else example_id.astype(_I32)
    if num_examples is not None and (policy.correction.dx_channel or policy.correction.dw):
        example_id = eqx.error_if(
            example_id,
            jnp.any((example_id < 0) | (example_id >= num_examples)),
            f"s3req.qragged_dot: example_id must lie in [0, num_examples={num_examples}).",
        )
    return _qragged(policy, num_examples or 1, x, w, group_sizes, key, row_id, example_id)
