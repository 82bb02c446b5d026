"""Cost of the power-of-two normalization of the scales of `qdot` (docs/guides/reliability.md).

Times one `qdot` forward+backward as it runs (scales normalized by powers of two, the largest
`|G|` found by one extra reduction) and with the normalization switched off (every shift 0,
so XLA folds the multiplications by 1 away and drops the reduction: the plain scales of
DESIGN.md section 3), both compiled first and then timed round-robin in one process; prints the
medians and their ratio.

    python benchmarks/scale_norm_cost.py [--shape 4x256x1024x4096] [--repeats 15]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from nan_check_cost import _program  # the same compiled fwd+bwd program

import s3req._backward as _backward
from policies import preset


def main():
    parser = argparse.ArgumentParser(description="Cost of the scale normalization of qdot.")
    parser.add_argument("--shape", default="4x256x1024x4096")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--policies", default="rtne,s3r,s3r-ec-2way")
    args = parser.parse_args()
    B, S, H, D = (int(n) for n in args.shape.split("x"))
    kx, kw, kg = jr.split(jr.key(0), 3)
    operands = (
        jr.normal(kx, (B, S, H), jnp.bfloat16),
        jr.normal(kw, (H, D)) / np.sqrt(H),
        jr.normal(kg, (B, S, D), jnp.bfloat16),
        jr.key(1),
    )
    print(f"qdot fwd+bwd x({B},{S},{H}) bf16 @ w({H},{D}) f32, {jax.devices()[0].platform}")
    for name in args.policies.split(","):
        policy = preset(name)
        normalized = _program(policy, operands)
        saved = _backward.normalizing_shift
        _backward.normalizing_shift = lambda *_: jnp.zeros((), jnp.int32)
        try:
            plain = _program(policy, operands)
        finally:
            _backward.normalizing_shift = saved
        times = {"normalized": [], "plain": []}
        for _ in range(args.repeats):
            for label, prog in (("normalized", normalized), ("plain", plain)):
                t0 = time.perf_counter()
                jax.block_until_ready(prog(*operands))
                times[label].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(
            f"{name:>12}: normalized {1e3 * med['normalized']:.1f} ms, plain "
            f"{1e3 * med['plain']:.1f} ms, ratio {med['normalized'] / med['plain']:.3f}"
        )


if __name__ == "__main__":
    main()
