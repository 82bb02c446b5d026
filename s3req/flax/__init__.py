"""Flax adapters: S3R in Flax linen and NNX layers (`pip install s3req[flax]`).

Not imported by `import s3req`. The stochastic keys come from the Flax RNG stream
`"s3req"` (`RNG_STREAM`): pass `rngs={"s3req": step_key}` to a linen `apply`, or give
`nnx.Rngs(s3req=...)` to the NNX adapters.
"""

from ._linen import dot_general_cls as dot_general_cls, DotGeneral as DotGeneral, Einsum as Einsum
from ._nnx import NnxDotGeneral as NnxDotGeneral, NnxEinsum as NnxEinsum
from ._stream import RNG_STREAM as RNG_STREAM
