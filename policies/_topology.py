"""Threshold topologies: where the stochastic-rounding thresholds come from."""

import typing

import equinox as eqx
from jaxtyping import Array, Int, PRNGKeyArray

from s3req import (
    AbstractTopology as AbstractTopology,
    Block,
    ELEMENT_BITS,
    element_thresholds,
    example_thresholds,
    Rows,
    SHARED_BITS,
    token_thresholds,
)


Layout = Block | Rows
Product = typing.Literal["dx", "dw"]
Thresholds = tuple[Int[Array, "..."], int]


@typing.final
class Nearest(AbstractTopology):
    """Deterministic round-to-nearest-even (the INT8 RTNE baseline). Needs no key.

    !!! Example

        ```python
        policy = Policy(Nearest())
        ```
    """

    stochastic: typing.ClassVar[bool] = False

    def quantizes_once(self) -> bool:
        return True

    def thresholds(self, key: PRNGKeyArray | None, layout: Layout, product: Product) -> None:
        return None


@typing.final
class Independent(AbstractTopology):
    """Independent stochastic rounding: one 32-bit Threefry word per gradient element.

    The top 23 bits of each word are the threshold (float32 cannot use more: the rounding bias
    is at most $\\Delta/2^{24}$). This is the expensive baseline S3R removes.

    **Arguments:**

    - `shared`: if `False` (default, as in AQT and the paper's baseline) the gradient is
      quantized twice, with independent thresholds for the dX and the dW GEMM; if `True` one
      threshold tensor and one int8 gradient serve both.
    """

    shared: bool = eqx.field(default=False, static=True)
    stochastic: typing.ClassVar[bool] = True

    def quantizes_once(self) -> bool:
        return self.shared

    def thresholds(self, key: PRNGKeyArray | None, layout: Layout, product: Product) -> Thresholds:
        assert key is not None
        return element_thresholds(key, layout), ELEMENT_BITS


@typing.final
class Phi2D(AbstractTopology):
    """S3R's default topology: one 7-bit threshold per token, shared across channels.

    $R_{b,s,h} = u_{b,s}$: `B*S/4` Threefry words per gradient tensor (four 7-bit thresholds
    per word), broadcast inside the quantizer fusion, never materialized at full size. One int8
    gradient feeds both backward GEMMs.
    """

    stochastic: typing.ClassVar[bool] = True

    def quantizes_once(self) -> bool:
        return True

    def thresholds(self, key: PRNGKeyArray | None, layout: Layout, product: Product) -> Thresholds:
        assert key is not None
        return token_thresholds(key, layout), SHARED_BITS


@typing.final
class PhiBcast(AbstractTopology):
    """The per-example ablation: one 7-bit threshold per example, shared by all its tokens.

    $R_{b,s,h} = u_b$. Cheapest, but correlates the errors of every token of an example; it
    needs the two-way correction to train (paper, Table I).
    """

    stochastic: typing.ClassVar[bool] = True

    def quantizes_once(self) -> bool:
        return True

    def thresholds(self, key: PRNGKeyArray | None, layout: Layout, product: Product) -> Thresholds:
        assert key is not None
        return example_thresholds(key, layout), SHARED_BITS


@typing.final
class Split(AbstractTopology):
    """Different topologies for the two backward GEMMs (the paper's Table II ablation rows).

    The gradient is quantized twice, with independent keys: once with the `dx` topology for
    the activation gradient and once with the `dw` topology for the weight gradient.

    **Arguments:**

    - `dx`: topology of the activation-gradient (dX) product.
    - `dw`: topology of the weight-gradient (dW) product.
    """

    dx: AbstractTopology
    dw: AbstractTopology

    @property
    def stochastic(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dx.stochastic or self.dw.stochastic

    def quantizes_once(self) -> bool:
        return False

    def thresholds(
        self, key: PRNGKeyArray | None, layout: Layout, product: Product
    ) -> Thresholds | None:
        inner = self.dx if product == "dx" else self.dw
        return inner.thresholds(key if inner.stochastic else None, layout, product)
