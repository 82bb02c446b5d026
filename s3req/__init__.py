"""s3req: fully quantized INT8 training with structured stochastic rounding (S3R, S3R-EC)."""

import importlib.metadata

from ._interfaces import (
    AbstractCorrection as AbstractCorrection,
    AbstractPolicy as AbstractPolicy,
    AbstractTopology as AbstractTopology,
)
from ._linear import QuantLinear as QuantLinear
from ._qdot import (
    gradient_codes as gradient_codes,
    MAX_TERMS as MAX_TERMS,
    qdot as qdot,
    quantize_gradient as quantize_gradient,
)
from ._quantize import (
    absmax_scale as absmax_scale,
    error_stats as error_stats,
    gradient_step as gradient_step,
    round_to_int8 as round_to_int8,
    sr_codes as sr_codes,
)
from ._sharding import ShardAxes as ShardAxes
from ._surgery import quantize as quantize
from ._threefry import random_bits as random_bits, threefry2x32 as threefry2x32
from ._thresholds import (
    Block as Block,
    element_thresholds as element_thresholds,
    example_thresholds as example_thresholds,
    Rows as Rows,
    token_thresholds as token_thresholds,
)


try:
    __version__ = importlib.metadata.version("s3req")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"
