"""The abstract interfaces the engine calls; `policies` implements them.

The engine (`qdot`, `qragged_dot`, `QuantLinear`) never imports `policies`: it asks a policy's
topology for thresholds, its gradient format for the codes, and its correction for the
corrected GEMM outputs. A new topology, format or correction is a new final class
implementing one of these interfaces; the engine does not change.
"""

import abc
from typing import Literal

import equinox as eqx
from jaxtyping import Array, Float, PRNGKeyArray

from ._formats import AbstractGradFormat
from ._thresholds import Layout, Thresholds


Product = Literal["dx", "dw"]
"""Which backward GEMM a gradient's codes feed: the activation (`"dx"`) or weight (`"dw"`) one."""


class AbstractTopology(eqx.Module):
    """How stochastic-rounding thresholds are laid out over the gradient tensor `G'`.

    A topology says whether it is stochastic and whether one quantized gradient feeds both
    backward GEMMs, and returns threshold indices for the part of `G'` a computation holds
    (its `layout`).
    """

    stochastic: eqx.AbstractVar[bool]
    """Whether thresholds are random (and calls need a `key`)."""

    @abc.abstractmethod
    def quantizes_once(self) -> bool:
        """Whether one quantized gradient feeds both the dX and the dW GEMM."""

    @abc.abstractmethod
    def thresholds(
        self, key: PRNGKeyArray | None, layout: Layout, product: Product
    ) -> Thresholds | None:
        """Threshold indices for `product`, or `None` to round to nearest even.

        **Arguments:**

        - `key`: the key of this backward pass; `None` exactly when the topology is not
          stochastic.
        - `layout`: the part of `G'` this computation holds: a [`s3req.Block`][] of the dense
          `(batch, seq, d_out)` tensor, or the expert-sorted `(n, d)` rows of a
          [`s3req.Rows`][]. The engine may ask for chunks of an expert GEMM's rows (on TPU):
          a row's thresholds must depend only on its ids and channels.
        - `product`: the GEMM the codes feed. When `quantizes_once()` is true the engine calls
          this once with `"dx"` and uses the codes for both GEMMs; otherwise once per product,
          with two independent keys.

        **Returns:**

        `(t, bits)`, `t` integer with a shape that broadcasts against the layout's block of
        `G'`: `(b, s, d)` for a `Block` (e.g. `(b, s, 1)` for one threshold per token), `(n, d)`
        for `Rows` (e.g. `(n, 1)`). Or `None`.
        """


class AbstractErrorTerms(abc.ABC):
    """The structured rounding error of the backward gradient, passed through both GEMMs.

    The engine implements this and hands it to [`s3req.AbstractCorrection.correct_dx`][]
    and [`s3req.AbstractCorrection.correct_dw`][]. With
    the rounding error $E = \\Delta Q - G'$ of every segment (an example of a dense layer, an
    `(example, expert)` segment of an expert GEMM), token means $\\varepsilon$, channel means
    $a$ and grand mean $m$, the structured part is $P = a + \\varepsilon - m$. Each method
    returns one part of $P$'s image in a GEMM output, in the units of the GEMM outputs the
    correction receives (before the final division by the scales), with the rank of that
    output and broadcastable to it (the dX terms for the rows of the dX output that
    `correct_dx` receives). A term is computed only when a correction asks for it.

    Under [`s3req.ShardAxes`][] the correction receives one shard's partial GEMM outputs (dX
    from the shard's `d_out` block of the weight, dW from its rows) and the terms are that
    shard's parts of the same sums; the engine adds the corrected outputs over the shards
    afterwards (one sum per gradient, or per chunk of dX rows), so a correction must be
    linear in its arguments, as subtracting terms is.

    For a topology that quantizes twice, the dX terms come from the dX codes and the dW terms
    from the dW codes.
    """

    @abc.abstractmethod
    def dx_token(self) -> Float[Array, "..."]:
        """$\\varepsilon\\, (W_q 1_D)^\\top$: the token means through the dX GEMM."""

    @abc.abstractmethod
    def dx_channel(self) -> Float[Array, "..."]:
        """$(a - m)\\, W_q^\\top$ (broadcast over the tokens): the centred channel means
        through the dX GEMM."""

    @abc.abstractmethod
    def dx_structured(self) -> Float[Array, "..."]:
        """$\\varepsilon\\, (W_q 1_D)^\\top + (a - m)\\, W_q^\\top$: the whole of $P$ through the
        dX GEMM, `dx_token() + dx_channel()` as one term (which the engine may form in one
        pass)."""

    @abc.abstractmethod
    def dw_token(self) -> Float[Array, "..."]:
        """$X_q^\\top \\varepsilon\\, 1_D^\\top$: the token means through the dW GEMM."""

    @abc.abstractmethod
    def dw_channel(self) -> Float[Array, "..."]:
        """$\\sum_b (X_q^\\top 1_S)_b (a - m)_b^\\top$ over segments: the centred channel means
        through the dW GEMM."""


class AbstractCorrection(eqx.Module):
    """Which parts of the structured rounding error (S3R-EC) are subtracted after the GEMMs.

    The rounding error of every segment is projected onto row-plus-column-constant matrices,
    $P = a + \\varepsilon - m$ (see [`s3req.AbstractErrorTerms`][]); a correction removes
    some of $P$'s effects on the two products.
    """

    @abc.abstractmethod
    def correct_dx(
        self, terms: AbstractErrorTerms, dx: Float[Array, "..."]
    ) -> Float[Array, "..."]:
        """The corrected dX GEMM output, e.g. `dx - terms.dx_token()` for dX-only EC.

        **Arguments:**

        - `terms`: the error terms of this backward pass, for the rows of `dx`: the engine
          may compute dX in chunks of rows (the expert GEMMs on TPU) and call this once per
          chunk, with `dx` and the dX terms of those rows. Only the `dx_*` terms are
          defined here.
        - `dx`: the dX GEMM output $\\Delta\\, Q W_q^\\top$ of those rows, before the
          division by `s_x` (under `ShardAxes`, this shard's part, see
          [`s3req.AbstractErrorTerms`][]).

        **Returns:**

        An array of `dx`'s shape.
        """

    @abc.abstractmethod
    def correct_dw(
        self, terms: AbstractErrorTerms, dw: Float[Array, "..."]
    ) -> Float[Array, "..."]:
        """The corrected dW GEMM output, e.g. `dw - terms.dw_token() - terms.dw_channel()`
        for two-way EC.

        **Arguments:**

        - `terms`: the error terms of this backward pass.
        - `dw`: the dW GEMM output $\\Delta\\, X_q^\\top Q$, before the division by `s_w`
          (under `ShardAxes`, this shard's part, from its rows).

        **Returns:**

        An array of `dw`'s shape.

        Before the GEMMs the engine also traces `correct_dx` and `correct_dw` once abstractly
        (`jax.eval_shape`, with every term zero) to learn which terms they ask for: on TPU
        the factors of the dW terms are summed over the chips before the GEMMs. So which
        terms a correction asks for must not depend on their values.
        """


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
