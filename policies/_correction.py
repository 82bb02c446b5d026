"""Error corrections (S3R-EC): which part of the known rounding error is subtracted."""

import typing

from s3req import AbstractCorrection as AbstractCorrection


@typing.final
class NoEC(AbstractCorrection):
    """No correction: the GEMM outputs are only rescaled."""

    dx_token: typing.ClassVar[bool] = False
    dx_channel: typing.ClassVar[bool] = False
    dw: typing.ClassVar[bool] = False


@typing.final
class DxOnlyEC(AbstractCorrection):
    """S3R-EC, dX-only: subtract each token's mean error from the activation gradient.

    `dX -= eps * (W 1_D) / s_x` with `eps[b, s]` the mean rounding error of token `(b, s)` over
    its channels. Enough for `Phi2D` (paper, Table I) and cheaper than the two-way correction.
    """

    dx_token: typing.ClassVar[bool] = True
    dx_channel: typing.ClassVar[bool] = False
    dw: typing.ClassVar[bool] = False


@typing.final
class TwoWayEC(AbstractCorrection):
    """S3R-EC, two-way: subtract the whole structured error from both gradients.

    With `P = a + eps - m` (channel means, token means and grand mean of the error of every
    example) passed through both products, the remaining error sums to zero along every token
    and every channel. Needed for `PhiBcast`.
    """

    dx_token: typing.ClassVar[bool] = True
    dx_channel: typing.ClassVar[bool] = True
    dw: typing.ClassVar[bool] = True


@typing.final
class DwOnlyEC(AbstractCorrection):
    """The ablation of the paper's Table II: subtract the structured error from dW only."""

    dx_token: typing.ClassVar[bool] = False
    dx_channel: typing.ClassVar[bool] = False
    dw: typing.ClassVar[bool] = True
