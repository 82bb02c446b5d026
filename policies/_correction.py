"""Error corrections (S3R-EC): which parts of the known rounding error are subtracted.

A correction receives the GEMM outputs and the engine's [`s3req.AbstractErrorTerms`][] and
returns the corrected outputs; the engine computes only the terms a correction asks for.
"""

import typing

from s3req import AbstractCorrection as AbstractCorrection


@typing.final
class NoEC(AbstractCorrection):
    """No correction: the GEMM outputs are only rescaled."""

    def correct(self, terms, dx, dw):
        return dx, dw


@typing.final
class DxOnlyEC(AbstractCorrection):
    """S3R-EC, dX-only: subtract each token's mean error from the activation gradient.

    `dX -= eps * (W 1_D) / s_x` with `eps[b, s]` the mean rounding error of token `(b, s)` over
    its channels. Enough for `Phi2D` (paper, Table I) and cheaper than the two-way correction.
    """

    def correct(self, terms, dx, dw):
        return dx - terms.dx_token(), dw


@typing.final
class TwoWayEC(AbstractCorrection):
    """S3R-EC, two-way: subtract the whole structured error from both gradients.

    With `P = a + eps - m` (channel means, token means and grand mean of the error of every
    example) passed through both products, the remaining error sums to zero along every token
    and every channel. Needed for `PhiBcast`.
    """

    def correct(self, terms, dx, dw):
        dx = dx - terms.dx_structured()
        return dx, dw - terms.dw_token() - terms.dw_channel()


@typing.final
class DwOnlyEC(AbstractCorrection):
    """The ablation of the paper's Table II: subtract the structured error from dW only."""

    def correct(self, terms, dx, dw):
        return dx, dw - terms.dw_token() - terms.dw_channel()
