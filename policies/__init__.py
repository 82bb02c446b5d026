"""Rounding policies for s3req: threshold topologies composed with error corrections."""

from s3req import (
    AbstractGradFormat as AbstractGradFormat,
    BlockFloatGrad as BlockFloatGrad,
    FP8_E5M2 as FP8_E5M2,
    INT4 as INT4,
    INT8 as INT8,
    IntGrad as IntGrad,
    MXFP4 as MXFP4,
    NVFP4 as NVFP4,
)

from ._correction import (
    AbstractCorrection as AbstractCorrection,
    DwOnlyEC as DwOnlyEC,
    DxOnlyEC as DxOnlyEC,
    NoEC as NoEC,
    TwoWayEC as TwoWayEC,
)
from ._policy import Policy as Policy, preset as preset, PRESETS as PRESETS
from ._topology import (
    AbstractTopology as AbstractTopology,
    Independent as Independent,
    Nearest as Nearest,
    Phi2D as Phi2D,
    PhiBcast as PhiBcast,
    Split as Split,
)
