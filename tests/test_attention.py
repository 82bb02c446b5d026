"""The models' attention against `jax.nn.dot_product_attention` (why it is not used).

`python tests/test_attention.py` prints the differences quoted in the models guide.
"""

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from models._llama import _attend


# The attention of the `tiny` preset at its training length: 4 query heads sharing 2 kv heads
# of width 32, 128 tokens, a batch of 4.
B, S, H, K, HD = 4, 128, 4, 2, 32


def _library(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return out.reshape(B, S, H * HD)


def _forward_and_grads(attend):
    """One compiled program: the output and the gradients of q, k, v for cotangent `cot`."""

    def run(q, k, v, cot):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(cot))

    return jax.jit(run)


def _measure(dtype) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Forward output and the gradients of q, k, v (for one random cotangent) of both
    implementations, as float64 arrays: {name: (ours, library)}."""
    kq, kk, kv, kg = jr.split(jr.key(0), 4)
    q = jr.normal(kq, (B, S, H, HD)).astype(dtype)
    k = jr.normal(kk, (B, S, K, HD)).astype(dtype)
    v = jr.normal(kv, (B, S, K, HD)).astype(dtype)
    cot = jr.normal(kg, (B, S, H * HD)).astype(dtype)
    ours = _forward_and_grads(_attend)(q, k, v, cot)
    # In bfloat16 the library mixes in float32 (forward and backward): it fails under strict
    # dtype promotion, which the models support and these tests use.
    with jax.numpy_dtype_promotion("standard"):
        lib = _forward_and_grads(_library)(q, k, v, cot)
    pairs = list(zip(("out", "dq", "dk", "dv"), ours, lib))
    for name, a, b in pairs:
        assert a.dtype == b.dtype == dtype, name
    return {n: (np.asarray(a, np.float64), np.asarray(b, np.float64)) for n, a, b in pairs}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_dot_product_attention_is_close_not_equal(dtype):
    """Forward and gradients agree to rounding: each element within one rounding of its own
    dtype, eps(dtype) |x|, plus the probabilistic error bound sqrt(S) eps(float32) max|x| of a
    float32 sum of S terms (both compute scores and softmax in float32). The gradients of q
    and k are not bitwise equal, so the models keep their own attention: switching would
    change every training run (the decision in the models guide)."""
    eps, eps32 = float(jnp.finfo(dtype).eps), float(jnp.finfo(jnp.float32).eps)
    equal = []
    for name, (a, b) in _measure(dtype).items():
        bound = eps * np.maximum(np.abs(a), np.abs(b)) + math.sqrt(S) * eps32 * np.abs(a).max()
        worst = float(np.max(np.abs(a - b) - bound))
        assert worst <= 0, f"{name}: beyond the rounding bound by {worst:.3g}"
        equal.append(bool(np.array_equal(a, b)))
    assert not all(equal), (
        "jax.nn.dot_product_attention is now bitwise equal to models._llama._attend, "
        "gradients included: adopt it in models/_llama.py and update the models guide."
    )


if __name__ == "__main__":
    print(f"jax {jax.__version__}, {jax.default_backend()}, B={B} S={S} H={H} K={K} hd={HD}")
    print("| dtype | tensor | max abs difference | max abs value | bitwise equal |")
    print("|---|---|---:|---:|---|")
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, (a, b) in _measure(dtype).items():
            print(
                f"| {jnp.dtype(dtype).name} | {name} | {np.abs(a - b).max():.3g} "
                f"| {np.abs(a).max():.3g} | {'yes' if np.array_equal(a, b) else 'no'} |"
            )
