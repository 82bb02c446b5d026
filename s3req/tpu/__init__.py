"""Compile for TPU chips ahead of time on a machine without one, and read what the compiler did.

`import s3req` does not import this submodule; `import s3req.tpu` needs no TPU, and its
compiling functions need `libtpu` (`pip install "s3req[tpu]"`), imported when first used.
See the guide `docs/guides/tpu-compile.md`.
"""

from ._buffers import (
    BufferPacking as BufferPacking,
    HeapBuffer as HeapBuffer,
    HeapTop as HeapTop,
    TOP_BUFFERS as TOP_BUFFERS,
)
from ._compile import (
    compile_for_tpu as compile_for_tpu,
    CostModel as CostModel,
    DEFAULT_TOPOLOGY as DEFAULT_TOPOLOGY,
    MemoryAnalysis as MemoryAnalysis,
    tpu_mesh as tpu_mesh,
    TPUProgram as TPUProgram,
)
from ._hlo import (
    Gemm as Gemm,
    hlo_buffers as hlo_buffers,
    HloTensor as HloTensor,
    parse_gemms as parse_gemms,
)
