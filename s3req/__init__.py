"""s3req: fully quantized INT8 training with structured stochastic rounding (S3R, S3R-EC)."""

import importlib.metadata

from ._backward import MAX_TERMS as MAX_TERMS
from ._dot_general import dot_general as dot_general
from ._float_sr import (
    float_format as float_format,
    FLOAT_FORMATS as FLOAT_FORMATS,
    float_thresholds as float_thresholds,
    FloatFormat as FloatFormat,
    grid_neighbours as grid_neighbours,
    sr_float as sr_float,
    stochastic_round as stochastic_round,
    THRESHOLD_BITS as THRESHOLD_BITS,
)
from ._formats import (
    AbstractGradFormat as AbstractGradFormat,
    BlockFloatGrad as BlockFloatGrad,
    FP8_E5M2 as FP8_E5M2,
    INT4 as INT4,
    INT8 as INT8,
    IntGrad as IntGrad,
    MXFP4 as MXFP4,
    NVFP4 as NVFP4,
)
from ._interfaces import (
    AbstractCorrection as AbstractCorrection,
    AbstractErrorTerms as AbstractErrorTerms,
    AbstractPolicy as AbstractPolicy,
    AbstractTopology as AbstractTopology,
)
from ._keys import bind_keys as bind_keys, unbind_keys as unbind_keys
from ._linear import QuantLinear as QuantLinear
from ._optim import (
    Adam8bitState as Adam8bitState,
    adam_8bit as adam_8bit,
    apply_updates_sr as apply_updates_sr,
    BlockQuantized as BlockQuantized,
    dequantize_blockwise as dequantize_blockwise,
    quantize_blockwise as quantize_blockwise,
    STATE_DTYPES as STATE_DTYPES,
    tree_bytes as tree_bytes,
)
from ._qdot import (
    gradient_codes as gradient_codes,
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
from ._ragged import qragged_dot as qragged_dot
from ._sharding import ShardAxes as ShardAxes
from ._surgery import quantize as quantize
from ._threefry import random_bits as random_bits, threefry2x32 as threefry2x32
from ._thresholds import (
    Block as Block,
    ELEMENT_BITS as ELEMENT_BITS,
    element_thresholds as element_thresholds,
    example_thresholds as example_thresholds,
    Rows as Rows,
    SHARED_BITS as SHARED_BITS,
    token_thresholds as token_thresholds,
)


try:
    __version__ = importlib.metadata.version("s3req")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"
