"""Cost of the power-of-two normalization of the scales of `qdot` (docs/guides/reliability.md).

Times one `qdot` forward+backward as it runs (scales normalized by powers of two, the largest
`|G|` found by one extra reduction) and with the normalization switched off (every shift 0,
so XLA folds the multiplications by 1 away and drops the reduction: the plain scales of
DESIGN.md section 3), both compiled first and then timed round-robin in one process; prints the
medians and their ratio.

    python benchmarks/scale_norm_cost.py [--shape 4x256x1024x4096] [--repeats 15]
"""

import contextlib

import jax.numpy as jnp
from nan_check_cost import compare  # the same compiled fwd+bwd program and timing

import s3req._backward as _backward


@contextlib.contextmanager
def _plain():
    saved = _backward.normalizing_shift
    _backward.normalizing_shift = lambda *_: jnp.zeros((), jnp.int32)
    try:
        yield
    finally:
        _backward.normalizing_shift = saved


def main():
    compare("Cost of the scale normalization of qdot.", ("normalized", "plain"), _plain)


if __name__ == "__main__":
    main()
