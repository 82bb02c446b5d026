#!/usr/bin/env bash
# The checks for a session that is lent a GPU: one call, from a copy of the checkout.
#   1. the compiled qdot forward + backward at two of the paper's FFN shapes (W2, W9) runs
#      its three layer GEMMs as int8 x int8 -> int32 (benchmarks/hlo_gemms.py; exit 1 if not);
#   2. Table III at three of the paper's exact FFN shapes (W1, W2, W9; all nine if
#      SHAPES=all), 8192 tokens per block: absolute times and ratios from one process;
#   3. the bare layer GEMMs, bf16 against int8, under XLA's default GEMM choice and with
#      cuBLAS only (benchmarks/gpu_gemms.py);
#   4. the dense layer's CUDA kernel against the reference path, other forms of its dX
#      GEMM and the block without its run-time checks, at W2 and W9 (benchmarks/gpu_kernels.py).
# About 7 minutes on an H200 (all shapes: more; split the call).
# The device has jax (CUDA), equinox, optax and jaxtyping but not beartype, so the packages
# run from the checkout (PYTHONPATH=.), with nothing installed. Results go to $OUT (the
# device tool's output folder) or docs/results/; copy them into docs/results/ and rerun
# `python experiments/results_index.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-docs/results}"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import jax; print(jax.__version__, jax.devices())"
status=0  # a failed int8 check still runs the timings, and sets the exit status
python benchmarks/hlo_gemms.py --shapes 4x2048x1024x4096,4x2048x8192x28672 --out "$out" || status=$?
shapes="${SHAPES:-W1,W2,W9}"
[ "$shapes" = all ] && shapes=W1,W2,W3,W4,W5,W6,W7,W8,W9
python experiments/table3_ffn_speed.py --full --shapes "$shapes" --repeats 5 --allocator current \
    --out "$out"
python benchmarks/gpu_gemms.py --shapes "$shapes" --out "$out"
python benchmarks/gpu_kernels.py --out "$out"
exit $status
