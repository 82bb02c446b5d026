"""Gradient formats: how the backward gradient `G'` is represented before the two GEMMs.

The default is int8 with one per-tensor step (the paper). The other formats of the second
paper's uses of stochastic rounding are a policy axis too: `Policy(Phi2D(), TwoWayEC(),
fmt=MXFP4)`. Every format rounds with the thresholds of the policy's topology, and the error
correction works for all of them because the rounding error is known exactly.
"""

import abc
import typing

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from ._float_sr import float_format, unchecked_sr_float
from ._quantize import ceil_pow2, gradient_step, sr_codes
from ._thresholds import Thresholds


class AbstractGradFormat(eqx.Module):
    """The number format of the quantized backward gradient.

    A format rounds the scale-folded gradient `G'` to codes `Q` and one per-tensor step
    `Delta`, such that `Delta * Q` is `G'` on the format's grid. The backward GEMMs multiply
    `Q` as its dtype says: int8 codes run as int8 x int8 GEMMs with exact int32 sums, float32
    codes as float32 GEMMs; then the engine multiplies by `Delta`.
    """

    @abc.abstractmethod
    def describe(self) -> str:
        """A short name for tables."""

    @abc.abstractmethod
    def round(
        self, y: Float[Array, "*rows d"], thresholds: Thresholds | None
    ) -> Shaped[Array, "*rows d"]:
        """Round `y`, already in units of the format's grid, with the given thresholds (see
        `quantize`): int8 codes or float32 grid values."""

    @abc.abstractmethod
    def quantize(
        self,
        gp: Float[Array, "*rows d"],
        amax: Float[Array, ""],
        thresholds: Thresholds | None,
    ) -> tuple[Shaped[Array, "*rows d"], Float[Array, ""]]:
        """Round `G'` with the given thresholds.

        The codes of a row must depend only on that row of `gp`, `amax` and the row's
        thresholds, and the step only on `amax`: the engine may call this for chunks of
        rows (an expert GEMM's backward on TPU) and join the codes.

        **Arguments:**

        - `gp`: `G'` (float32): the rows of the gradient this computation holds, channels last.
        - `amax`: `max|G'|` over the whole logical tensor (finite).
        - `thresholds`: `(t, bits)` from the topology, broadcastable to `gp`, or `None` for
          round-to-nearest-even.

        **Returns:**

        `(Q, Delta)`: the codes (int8, or float32 values) and the per-tensor step.
        """


@typing.final
class IntGrad(AbstractGradFormat):
    """Integer codes in `[-qmax, qmax]`, `qmax = 2**(bits-1) - 1`, one per-tensor step
    `delta = max|G'| / qmax`.

    `bits=8` is the paper's format. `bits=4` stores int4 values in int8 containers: the GEMMs
    are the same int8 x int8 -> int32 GEMMs (exact), as no CPU or XLA has an int4 GEMM.

    **Arguments:**

    - `bits`: 2 to 8 (default 8).
    """

    bits: int = eqx.field(default=8, static=True)

    def __check_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"IntGrad: bits must lie in [2, 8], got {self.bits}.")

    @property
    def qmax(self) -> int:
        """The largest code."""
        return 2 ** (self.bits - 1) - 1

    def describe(self) -> str:
        return f"int{self.bits}"

    def round(self, y, thresholds):
        """int8 codes of `y` (in steps, `|y| <= qmax`), see [`s3req.sr_codes`][]."""
        t, bits = (None, 0) if thresholds is None else thresholds
        return sr_codes(y, t, bits, qmax=self.qmax)

    def quantize(self, gp, amax, thresholds):
        """Codes of `G' / Delta` in `[-qmax, qmax]` (int8), `Delta = max|G'| / qmax`; an
        all-zero gradient gets `Delta = 0` and all codes 0."""
        delta, inv = gradient_step(amax, self.qmax)
        return self.round(jnp.clip(gp * inv, -self.qmax, self.qmax), thresholds), delta


@typing.final
class BlockFloatGrad(AbstractGradFormat):
    """A narrow float format with one scale per block of `block` channels of every token.

    `G'` is divided by its block scale `s = max|block| / max_finite` (rounded up to a power of
    two for MX-style scales) and stochastically rounded onto the float grid with
    [`s3req.sr_float`][] (the ulp of each value; thresholds from the policy's topology). The
    GEMMs then run on the **dequantized** values in float32: there is no FP8/FP4 GEMM on CPU
    and the block scales run along the dX contraction. The numerics are those of the format.

    **Arguments:**

    - `dtype`: `"float8_e5m2"`, `"float8_e4m3fn"` or `"float4_e2m1fn"`.
    - `block`: channels per scale (32 for MXFP4, 16 for NVFP4), or `None` for one per-tensor
      scale.
    - `pow2`: power-of-two scales (MX's E8M0) instead of float32 scales.
    """

    dtype: str = eqx.field(static=True)
    block: int | None = eqx.field(default=None, static=True)
    pow2: bool = eqx.field(default=False, static=True)

    def __check_init__(self):
        if self.dtype not in ("float8_e5m2", "float8_e4m3fn", "float4_e2m1fn"):
            raise ValueError(
                "BlockFloatGrad: dtype must be 'float8_e5m2', 'float8_e4m3fn' or "
                f"'float4_e2m1fn', got {self.dtype!r}."
            )
        if self.block is not None and self.block < 1:
            raise ValueError(f"BlockFloatGrad: block must be positive, got {self.block}.")

    def describe(self) -> str:
        b = "tensor" if self.block is None else f"1x{self.block}"
        return f"{self.dtype}/{b}{'/pow2' if self.pow2 else ''}"

    def scales(self, amax: Float[Array, "..."]) -> Float[Array, "..."]:
        """Block scales from block maxima (zero blocks get scale 1)."""
        top = float_format(jnp.dtype(self.dtype)).max_finite
        s = amax / top
        if self.pow2:  # the smallest power of two >= s, exact (XLA's exp2 is not)
            s = ceil_pow2(jnp.where(s > 0, s, 1.0))
        return jnp.where(amax > 0, s, jnp.ones_like(s))

    def round(self, y, thresholds):
        """`y` (already divided by its scale) on the float grid, see [`s3req.sr_float`][];
        float32 result. A non-finite `y` is not checked here: the backward checks the
        upstream gradient itself, on `dX` and `dW`, so the rounding does not wait for it."""
        t, bits = (None, 0) if thresholds is None else thresholds
        fmt = float_format(self.dtype)
        return unchecked_sr_float(y.astype(jnp.float32), fmt, t, bits).astype(jnp.float32)

    def quantize(self, gp, amax, thresholds):
        """Grid values of `G' / s` times the block scales `s` (float32). A per-tensor scale
        is returned as the step instead, so the codes stay on the grid."""
        if self.block is None:
            s = self.scales(amax)
            return self.round(gp / s, thresholds), s
        *lead, D = gp.shape
        if D % self.block:
            raise ValueError(
                f"s3req: the gradient format {self.describe()} needs the gradient's channels "
                f"({D} per shard) to be a multiple of the block size {self.block}."
            )
        g4 = gp.reshape(*lead, D // self.block, self.block)
        s = self.scales(jnp.max(jnp.abs(g4), axis=-1, keepdims=True))
        q = self.round((g4 / s).reshape(gp.shape), thresholds)
        return (q.reshape(g4.shape) * s).reshape(gp.shape), jnp.ones((), jnp.float32)


INT8 = IntGrad(8)
"""The paper's format: int8 codes, one per-tensor step."""
INT4 = IntGrad(4)
"""int4 codes (in int8 containers), one per-tensor step."""
FP8_E5M2 = BlockFloatGrad("float8_e5m2")
"""float8 e5m2 with one per-tensor scale."""
MXFP4 = BlockFloatGrad("float4_e2m1fn", block=32, pow2=True)
"""MXFP4-style: float4 e2m1 with a power-of-two scale per 32 channels."""
NVFP4 = BlockFloatGrad("float4_e2m1fn", block=16)
"""NVFP4-style: float4 e2m1 with a float32 scale per 16 channels (NVFP4 stores it in e4m3)."""
