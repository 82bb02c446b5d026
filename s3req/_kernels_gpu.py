"""The XLA:GPU (CUDA) kernel: the dense layer's dX GEMM reads its int8 codes as plain operands.

`_backward.py` holds the reference path, written as the maths; `_backward.Dense` chooses this
form in programs lowered for CUDA. Figures: the SwiGLU FFN block's forward + backward at the
paper's W9 shape (H 8192, D_ffn 28672, 8192 tokens) on an NVIDIA H200 with jax 0.11.2
(`benchmarks/gpu_kernels.py`, `docs/results/gpu_kernels.md`).

**The dX GEMM's operands** (`plain_operands`). Where one set of gradient codes feeds both
backward GEMMs (a topology that quantizes once: RTNE, S3R), XLA:GPU fused the dX GEMM
`Q Wq^T` of the gate and up projections, together with the transposes of its int8 operands
and the float32 rescaling of its int32 result, into a Triton GEMM fusion, far slower than
cuBLAS's int8 GEMM of that shape (about 3 ms, `docs/results/gpu_gemms.md`): the block took
63.0 ms against BF16's 50.9. Passing the codes and the weight codes through
`jax.lax.optimization_barrier` makes them operands the GEMM reads from memory as they are, and
XLA then runs every layer GEMM as a cuBLAS int8 call: RTNE took 43.0 ms, 1.18 times faster
than BF16. A barrier on the weight codes alone, or on the GEMM's int32 result, left the Triton
fusions in place. The barrier is an identity: the gradients are
the reference's bit for bit (`tests/test_kernels.py`).

Inside `shard_map` (`ShardAxes`) the layer keeps the reference form: one barrier's outputs
vary over the mesh axes of all its inputs, so `Wq` would vary over the codes' batch axes.
Programs sharded by `jax.jit` get the barrier.
"""

import jax
from jaxtyping import Array


def plain_operands(q: Array, wq: Array) -> tuple[Array, Array]:
    """`(q, wq)` behind an `optimization_barrier`: the GEMM that reads them cannot fuse
    their producers or layout changes into itself."""
    return jax.lax.optimization_barrier((q, wq))
