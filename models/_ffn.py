"""The SwiGLU feed-forward block and the paper's FFN benchmark shapes."""

import functools as ft
import typing

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from s3req import AbstractPolicy, QuantLinear

from ._sharding import shard_batch


PAPER_FFN_SHAPES: dict[str, tuple[int, int]] = {
    "W1": (512, 2048),
    "W2": (1024, 4096),
    "W3": (2048, 8192),
    "W4": (3072, 12288),
    "W5": (3840, 15360),
    "W6": (4096, 12288),
    "W7": (4096, 14336),
    "W8": (5120, 17920),
    "W9": (8192, 28672),
}
"""`(d_model, d_ff)` of the nine SwiGLU FFN blocks W1..W9 of the paper's Table III."""


def _split3(key: PRNGKeyArray | None) -> tuple[PRNGKeyArray | None, ...]:
    return (None, None, None) if key is None else tuple(jr.split(key, 3))


@typing.final
class FFN(eqx.Module):
    """A SwiGLU feed-forward block: $\\mathrm{down}(\\mathrm{silu}(\\mathrm{gate}(x)) \\odot
    \\mathrm{up}(x))$, every projection a bias-free [`s3req.QuantLinear`][].

    It is the FFN of every dense [`models.Llama`][] layer and, alone, the block of the paper's
    FFN benchmarks (`PAPER_FFN_SHAPES`).

    **Arguments:**

    - `d_model`: input and output width.
    - `d_ff`: hidden width.
    - `policy`: the rounding policy of the three projections, or `None` (plain float).
    - `dtype`: parameter dtype (default float32).
    - `key`: initialisation key. (Keyword only argument.)

    !!! Example

        ```python
        import jax.random as jr
        from models import FFN, PAPER_FFN_SHAPES
        from policies import Policy, Phi2D, DxOnlyEC

        d_model, d_ff = PAPER_FFN_SHAPES["W1"]
        init_key, data_key, step_key = jr.split(jr.key(seed := 0), 3)
        ffn = FFN(d_model, d_ff, Policy(Phi2D(), DxOnlyEC()), key=init_key)
        y = ffn(jr.normal(data_key, (2, 128, d_model)), key=step_key)
        ```
    """

    gate: QuantLinear
    up: QuantLinear
    down: QuantLinear

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        policy: AbstractPolicy | None,
        *,
        dtype: typing.Any = None,
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jr.split(key, 3)
        linear = ft.partial(QuantLinear, policy=policy, use_bias=False, dtype=dtype)
        self.gate = linear(d_model, d_ff, key=kg)
        self.up = linear(d_model, d_ff, key=ku)
        self.down = linear(d_ff, d_model, key=kd)

    def __call__(
        self, x: Float[Array, "*batch d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch d_model"]:
        """Apply the block.

        **Arguments:**

        - `x`: activations `(batch, seq, d_model)` (or `(seq, d_model)`).
        - `key`: a fresh key, split into one per projection; required when the policy is
          stochastic. (Keyword only argument.)

        **Returns:**

        `(..., d_model)` in the dtype of `x`.
        """
        kg, ku, kd = _split3(key)
        h = jax.nn.silu(self.gate(x, key=kg)) * self.up(x, key=ku)
        if h.ndim == 3:  # (batch, seq, d_ff): keep the batch split on a mesh
            h = shard_batch(h)
        return self.down(h, key=kd)
