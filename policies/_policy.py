"""`Policy`: a threshold topology composed with an error correction, and the string presets."""

import typing

import equinox as eqx

from s3req import AbstractCorrection, AbstractGradFormat, AbstractPolicy, AbstractTopology, INT8

from ._correction import DxOnlyEC, NoEC, TwoWayEC
from ._topology import Independent, Nearest, Phi2D, PhiBcast


@typing.final
class Policy(AbstractPolicy):
    """How the backward gradient of every quantized matmul is rounded.

    A policy composes a threshold topology with an error correction, the way
    `lineax.Normal(inner)` wraps another solver. It holds no arrays and no keys: it is a
    hashable, immutable description that `jax.jit` treats as static.

    **Arguments:**

    - `topology`: one of `Nearest()`, `Independent()`, `Phi2D()`, `PhiBcast()`, `Split(...)`.
    - `correction`: one of `NoEC()` (default), `DxOnlyEC()`, `TwoWayEC()`, `DwOnlyEC()`.
    - `fmt`: the gradient format: `INT8` (default, the paper), `INT4`, `FP8_E5M2`, `MXFP4`,
      `NVFP4`, or any `IntGrad(bits)` / `BlockFloatGrad(dtype, block, pow2)`.

    !!! Example

        ```python
        from policies import Policy, Phi2D, TwoWayEC
        policy = Policy(Phi2D(), TwoWayEC())   # S3R-EC, two-way
        ```
    """

    topology: AbstractTopology
    correction: AbstractCorrection = eqx.field(default_factory=NoEC)
    fmt: AbstractGradFormat = INT8

    def __check_init__(self):
        if not isinstance(self.topology, AbstractTopology):
            raise TypeError(
                f"Policy: `topology` must be a topology such as Phi2D(), got {self.topology!r}."
            )
        if not isinstance(self.correction, AbstractCorrection):
            raise TypeError(
                "Policy: `correction` must be NoEC(), DxOnlyEC(), TwoWayEC() or DwOnlyEC(), "
                f"got {self.correction!r}."
            )
        if not isinstance(self.fmt, AbstractGradFormat):
            raise TypeError(
                f"Policy: `fmt` must be a gradient format such as INT8 or MXFP4, got {self.fmt!r}."
            )
        if isinstance(self.topology, Nearest) and not isinstance(self.correction, NoEC):
            raise ValueError(
                "Policy: error correction needs stochastic rounding; round-to-nearest has a "
                "deterministic error that EC would not keep unbiased. Use NoEC() with Nearest()."
            )


PRESETS: dict[str, Policy | None] = {
    "bf16": None,
    "rtne": Policy(Nearest()),
    "sr": Policy(Independent()),
    "s3r": Policy(Phi2D()),
    "s3r-bcast": Policy(PhiBcast()),
    "s3r-ec-dx": Policy(Phi2D(), DxOnlyEC()),
    "s3r-ec-2way": Policy(Phi2D(), TwoWayEC()),
    "s3r-bcast-ec-dx": Policy(PhiBcast(), DxOnlyEC()),
    "s3r-bcast-ec-2way": Policy(PhiBcast(), TwoWayEC()),
}
"""The paper's table rows by name (`"bf16"` is `None`: the plain float layer)."""


def preset(name: str) -> Policy | None:
    """The policy of a table row by name: one of the keys of `PRESETS`.

    **Arguments:**

    - `name`: `bf16, rtne, sr, s3r, s3r-bcast, s3r-ec-dx, s3r-ec-2way, s3r-bcast-ec-dx,
      s3r-bcast-ec-2way`.

    **Returns:**

    The `Policy`, or `None` for `"bf16"`.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"Unknown policy {name!r}; choose one of: {', '.join(PRESETS)}."
        ) from None
