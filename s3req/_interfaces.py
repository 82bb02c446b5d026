"""The abstract interfaces the engine calls; `policies` implements them.

The engine (`qdot`, `QuantLinear`) never imports `policies`: it asks a policy's topology for
thresholds and its correction for which terms of the structured error to subtract.
"""

import abc
from typing import Literal

import equinox as eqx
from jaxtyping import Array, Int, PRNGKeyArray

from ._formats import AbstractGradFormat
from ._thresholds import Layout


Product = Literal["dx", "dw"]


class AbstractTopology(eqx.Module):
    """How stochastic-rounding thresholds are laid out over the gradient tensor `G'`.

    A topology says whether it is stochastic, whether one quantized gradient feeds both
    backward GEMMs, and produces integer threshold indices `t` with `bits` bits (the real
    threshold is $(t + 1/2)/2^{bits}$) broadcastable to a `(b, s, d)` block of `G'` (a
    [`s3req.Block`][]) or to the `(n, d)` rows of an expert GEMM (a [`s3req.Rows`][]).
    """

    stochastic: eqx.AbstractVar[bool]
    """Whether thresholds are random (and calls need a `key`)."""

    @abc.abstractmethod
    def quantizes_once(self) -> bool:
        """Whether one int8 gradient feeds both the dX and the dW GEMM."""

    @abc.abstractmethod
    def thresholds(
        self, key: PRNGKeyArray, block: Layout, product: Product
    ) -> tuple[Int[Array, "b s d"], int] | None:
        """Threshold indices and their bit width for `product` (`None`: round to nearest even).

        When `quantizes_once()` is true the engine calls this once with `product="dx"` and uses
        the result for both GEMMs; otherwise it calls it with two independent keys.
        """


class AbstractCorrection(eqx.Module):
    """Which parts of the structured rounding error (S3R-EC) are subtracted after the GEMMs.

    The rounding error of example `b` is projected onto row-plus-column-constant matrices:
    $P = a + \\varepsilon - m$ (channel means, token means, grand mean). The correction picks
    which of its effects on the two products to remove.
    """

    dx_token: eqx.AbstractClassVar[bool]
    """Subtract the token-mean term $\\varepsilon\\, W 1_D$ from dX."""
    dx_channel: eqx.AbstractClassVar[bool]
    """Subtract the channel-mean term $(a - m) W^\\top$ from dX."""
    dw: eqx.AbstractClassVar[bool]
    """Subtract both terms of $P$ from dW."""


class AbstractPolicy(eqx.Module):
    """A rounding policy: a threshold topology composed with an error correction, and the
    number format of the quantized gradient."""

    topology: eqx.AbstractVar[AbstractTopology]
    correction: eqx.AbstractVar[AbstractCorrection]
    fmt: eqx.AbstractVar[AbstractGradFormat]

    @property
    def stochastic(self) -> bool:
        """Whether calls need a `key`."""
        return self.topology.stochastic
