"""Error corrections (S3R-EC): which parts of the known rounding error are subtracted.

A correction receives a GEMM output (dX, or dW) and the engine's
[`s3req.AbstractErrorTerms`][] and returns the corrected output; the engine computes only the
terms a correction asks for.
"""

import typing

from s3req import AbstractCorrection as AbstractCorrection


@typing.final
class NoEC(AbstractCorrection):
    """No correction: the GEMM outputs are only rescaled."""

    def correct_dx(self, terms, dx):
        return dx

    def correct_dw(self, terms, dw):
        return dw


@typing.final
class DxOnlyEC(AbstractCorrection):
    """S3R-EC, dX-only: subtract each token's mean error from the activation gradient.

    `dX -= eps * (W 1_D) / s_x` with `eps[b, s]` the mean rounding error of token `(b, s)` over
    its channels. Enough for `Phi2D` (paper, Table I) and cheaper than the two-way correction.
    """

    def correct_dx(self, terms, dx):
        return dx - terms.dx_token()

    def correct_dw(self, terms, dw):
        return dw


@typing.final
class TwoWayEC(AbstractCorrection):
    """S3R-EC, two-way: subtract the whole structured error from both gradients.

    With `P = a + eps - m` (channel means, token means and grand mean of the error of every
    example) passed through both products, the remaining error sums to zero along every token
    and every channel. Needed for `PhiBcast`.
    """

    def correct_dx(self, terms, dx):
        return dx - terms.dx_structured()

    def correct_dw(self, terms, dw):
        return dw - terms.dw_token() - terms.dw_channel()


@typing.final
class DwOnlyEC(AbstractCorrection):
    """The ablation of the paper's Table II: subtract the structured error from dW only."""

    def correct_dx(self, terms, dx):
        return dx

    def correct_dw(self, terms, dw):
        return dw - terms.dw_token() - terms.dw_channel()
