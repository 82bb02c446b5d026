"""Pure-jnp Threefry and the threshold layouts: bit-exact against jax.random.bits."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from s3req import (
    Block,
    element_thresholds,
    example_thresholds,
    random_bits,
    Rows,
    token_thresholds,
)
from s3req._threefry import linear_index


@pytest.mark.parametrize("shape", [(7,), (3, 5, 4), (2, 33, 17), (1, 1, 1)])
def test_bits_match_jax(shape, getkey):
    key = getkey()
    np.testing.assert_array_equal(random_bits(key, shape), jr.bits(key, shape, jnp.uint32))


def test_bits_of_a_block(getkey):
    key = getkey()
    full = jr.bits(key, (6, 40, 3), jnp.uint32)
    block = random_bits(key, (6, 40, 3), start=(2, 8, 1), shape=(3, 16, 2))
    np.testing.assert_array_equal(block, full[2:5, 8:24, 1:3])
    # traced offsets (as inside shard_map)
    f = jax.jit(lambda s: random_bits(key, (6, 40, 3), start=(s, 8, 0), shape=(2, 4, 3)))
    np.testing.assert_array_equal(f(jnp.int32(4)), full[4:6, 8:12])


def test_raw_and_typed_keys_agree():
    typed = jr.key(11)
    raw = jr.key_data(typed)
    np.testing.assert_array_equal(random_bits(typed, (5,)), random_bits(raw, (5,)))
    # a batch of keys is rejected (by jaxtyping when checks are on, else by key_words)
    with pytest.raises((ValueError, TypeError)):
        random_bits(jr.split(typed, 2), (5,))


def test_64bit_counters():
    """Linear indices past 2**32 carry into the high word (checked against Python ints)."""
    shape = (3, 2**20, 2**13)  # 2**34 elements
    start = (2, 2**20 - 3, 2**13 - 2)
    hi, lo = linear_index(shape, start, (1, 2, 3))
    for i in range(2):
        for j in range(3):
            n = ((start[0]) * shape[1] + start[1] + i) * shape[2] + start[2] + j
            assert (int(hi[0, i, j]) << 32) + int(lo[0, i, j]) == n


def test_token_thresholds_are_bytes_of_words(getkey):
    """Token n takes byte n % 4 (low 7 bits) of word n // 4: B*S/4 words per tensor."""
    key = getkey()
    B, S, D = 3, 12, 5
    words = np.asarray(jr.bits(key, (B * S // 4,), jnp.uint32))
    n = np.arange(B * S)
    ref = (words[n // 4] >> (8 * (n % 4)).astype(np.uint32)) & 0x7F
    t = token_thresholds(key, Block.whole((B, S, D)))
    assert t.shape == (B, S, 1)
    np.testing.assert_array_equal(np.asarray(t).reshape(-1), ref)
    # an unaligned block (general path) agrees with the aligned computation
    blk = Block((B, S, D), (1, 3, 0), (2, 7, D))
    np.testing.assert_array_equal(token_thresholds(key, blk), t[1:3, 3:10])
    # S not divisible by 4
    t2 = token_thresholds(key, Block.whole((2, 7, D)))
    w2 = np.asarray(jr.bits(key, (4,), jnp.uint32))
    n2 = np.arange(14)
    np.testing.assert_array_equal(
        np.asarray(t2).reshape(-1), (w2[n2 // 4] >> (8 * (n2 % 4)).astype(np.uint32)) & 0x7F
    )


def test_example_and_element_thresholds(getkey):
    key = getkey()
    B, S, D = 6, 4, 5
    te = example_thresholds(key, Block.whole((B, S, D)))
    assert te.shape == (B, 1, 1)
    tt = token_thresholds(key, Block.whole((B, 1, D)))  # same byte layout over examples
    np.testing.assert_array_equal(te, tt)
    tel = element_thresholds(key, Block.whole((B, S, D)))
    np.testing.assert_array_equal(tel, jr.bits(key, (B, S, D), jnp.uint32) >> 9)
    assert int(tel.max()) < 2**23


def test_rows_layout_uses_global_ids(getkey):
    """Ragged rows are keyed by global id, so any permutation of rows permutes thresholds."""
    key = getkey()
    B, S, D = 2, 8, 5
    ids = jnp.array([3, 9, 0, 15, 9], jnp.int32)
    rows = Rows(ids, ids // S, D)
    dense_tok = token_thresholds(key, Block.whole((B, S, D))).reshape(-1)
    np.testing.assert_array_equal(token_thresholds(key, rows)[:, 0], dense_tok[ids])
    dense_el = element_thresholds(key, Block.whole((B * S, 1, D))).reshape(B * S, D)
    np.testing.assert_array_equal(element_thresholds(key, rows), dense_el[ids])
    dense_ex = example_thresholds(key, Block.whole((B, S, D))).reshape(-1)
    np.testing.assert_array_equal(example_thresholds(key, rows)[:, 0], dense_ex[ids // S])


def test_thresholds_uniform(getkey):
    """7-bit thresholds are uniform on 0..127 (chi-square, 127 dof, 5-sigma bound)."""
    t = token_thresholds(getkey(), Block.whole((64, 1024, 1))).reshape(-1)
    counts = np.bincount(np.asarray(t), minlength=128)
    assert counts.size == 128
    expected = t.size / 128
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 127 + 5 * np.sqrt(2 * 127)
