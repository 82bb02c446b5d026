"""The XLA:TPU kernels: when a dense layer's error-correction terms are computed, and the
expert GEMM's error-correction statistics.

`_backward.py` holds the reference path, written as the maths; `_backward.Dense` and
`_backward.Ragged` choose these forms in programs lowered for TPU. Memory figures are XLA's
temporaries on the SwiGLU FFN block of `benchmarks/tpu_compile.py` (v5p, the batch split
over 4 chips), over S3R's.

**A dense layer's terms, and when they are computed.** A small buffer that lives long can
keep a large one out of the range a dead buffer freed (the compile guide's packing section),
so the terms are computed in the backward, when the layer needs them:

- *The dW terms' sums over the chips* (`sum_first`). Under `jax.jit` with the batch
  sharded, the SPMD partitioner sums the dW terms' factors over the chips, `Xq^T eps` and
  the channel term `sum_b xsum_b (a - m)_b^T`, each with an all-reduce of its own.
  XLA:TPU's all-reduce combiner merged those of every layer with the dW all-reduces of the
  layers after it, which run at the end of the backward, keeping the factors' partial sums
  alive across it: two-way EC needed +35 to +51% at W3-W8 (with the combiner off,
  `xla_jf_crs_combiner_threshold_count=1`: +0.3% at W1, +4.4% at W4, +6.7% at W6).
  `sum_first` ties the summed factors to the codes (`jax.lax.optimization_barrier`): the
  GEMMs, and with them the backward of every later layer, wait for these sums, so no later
  all-reduce can be merged with them. The per-example factors of the channel term are made
  whole on every chip first (`_replicated`, an identity product the partitioner sums over
  the chips), so that the channel term is a product on every chip rather than one more
  all-reduce, of the weight's size. Only programs whose rows are split by `jax.jit`
  sharding (or not at all) do this; inside `shard_map` (`ShardAxes`) the engine adds the
  shard sums itself, once per gradient.
- *The row sums* `Wq 1_D` of dX's token term depend on the weights alone, so XLA computed
  them in the forward, right after `Wq`, and kept them until the dX correction: dX-only EC
  needed +5.7% at W6 and W7, +20.6% at W9. They are taken once the codes exist (`after`),
  outside `shard_map` (inside it the codes vary over more mesh axes than the weights).
- *dW and its terms, before the layers below run their backward* (`together`). The
  partitioner sums a dense layer's int32 dW over the chips (an all-reduce) and the
  correction follows that sum. Where the weights are small, XLA:TPU's all-reduce combiner
  merged the dW sums of the FFN block's three projections into one at the end of the
  backward (W1, W2: 4 and 16 MiB per projection), so the `down` projection's summed factors
  (`f32[d, 1]`, `f32[B, d]`) and its checks' flags lived across the backward of `gate` and
  `up`: small buffers in the middle of the block of temporaries that kept a freed range of
  a gradient's size from being reused. Two-way EC needed +48.8% (W1) and +62.4% (W2)
  temporaries over S3R, with the same live bytes at W1. `together` hands dX on only once the
  checked dW exists (`jax.lax.optimization_barrier`), for layers whose dW has terms, so
  that layer's dW sum and correction are done before the layers below it start: +0.1% at W1
  and +0.2% at W2 (`benchmarks/tpu_compile.py`). What it costs, where two-way EC was within
  +0.4% of S3R before: the schedule keeps 16.1 MiB more live at W3 and 87.8 MiB at W8 (+1.7%
  and +3.7% temporaries), and W9's block has a hole of 227.5 MiB (+11.2% temporaries, its
  live bytes 221.5 MiB below S3R's and its peak 2.6%; `benchmarks/tpu_packing.py`); on a
  TPU the dW sum of such a layer no longer overlaps with the backward of the layers below
  it (the compiler's cost model, a model, moves by -5% to +0.7% on the blocks; not timed
  on a TPU). Under `shard_map` the engine adds the terms before its own shard sum, and
  nothing is tied. The VJP computes only the gradients of the differentiated inputs
  (`_backward.quantized_matmul`), so a frozen weight's dW is not kept alive by the tie.
- *The token term's factor `Xq^T eps` from the codes* (`token_operands`). As a product of `eps`
  with the codes, XLA:TPU fuses the quantizer that makes `Xq` into it and quantizes the
  layer's input again there: in Table IV's DeepSeek-V2-Lite step (1-layer cut) that keeps a
  float32 input `f32[8, 4096, 1024]` (128 MiB per chip) from the recomputed forward to the
  backward. With `eps` and `Xq` through one `jax.lax.optimization_barrier` the product
  reads the int8 codes once `eps` exists: two-way EC needs 14773 MiB of temporaries and a
  peak of 16752 there, against 15165 and 16937 without it (S3R: 14333 and 16293; the
  packing page's two-way rows at `c68b4c1` and `283cdab`).
  Llama 3.1-8B's and Qwen3-30B-A3B's 1-layer steps (`benchmarks/tpu_compile.py --parts
  table4 --layers 1`) are the same within 0.1 MiB either way; on the FFN blocks the barrier
  costs +15.7 MiB at W3 (two-way +1.7% -> +3.1% temporaries over S3R) and changes the
  others by at most 1.1 MiB. Outside `shard_map` only (inside it the barrier would make
  `eps` vary over the codes' mesh axes).
- *The sums of the codes over the tokens* (`Xq`'s, for the channel term) are a reduction
  over the tokens (the reference's): as an int8 product with a ones vector, XLA:TPU laid the
  `down` projection's codes out tokens-minor at W2 and kept a copy of its input in that
  layout through the backward (two-way EC +68 MiB of live bytes, 13% over S3R's).

**The expert GEMM's statistics.** In the reference the sums over the rows of every
`(example, expert)` segment are `jax.ops.segment_sum`s, and `Xq_e^T eps_e` a float32
product. XLA TPU (v5p) compiles both into buffers of the activations' size:

- it offloads a scatter-add to the SparseCore, which reads its updates from memory, so the
  segment sums of `Xq` write an int32 `(n, h)` copy of the codes and those of the error `E`
  a float32 `(n, d)` one;
- a float32 (or default-precision bf16) product with `Xq` writes the converted `Xq` to
  memory.

Here the segment sums are ragged contractions of the rows with the one-hot matrix of their
example (a ragged contracting dimension, int8 x int8 with int32 sums for codes, float32 for
floats): XLA computes both operands inside the contraction. Those of `E` are taken as
`Delta` times the exact sums of the codes minus those of `G' = s_x G s_w`, and the sums of
`G'` as `s_w` times a ragged contraction of the one-hot scaled by `s_x` with the upstream
gradient itself (`folded_segment_sums`): as an operand, `E` (or `G'`) is a float32 `(n, d)`
array that XLA writes to memory, where `G` is already there (bfloat16, half the bytes) and
only its row chunks (`FOLD_CHUNK`) are copied. `Xq_e^T eps_e` is an int8 ragged contraction
of `Xq` with `EPS_DIGITS` signed base-128 int8 digits of `eps` (`_gemms.int8_digits`, as
the CPU kernel's products with codes), exact in int32, the digits' remainder below float32
precision; it and the segment sums of `Xq` are one contraction of the rows `[digits of eps,
one-hot of the example]` with `Xq` (`xq_sums`): one pass over `Xq`, whose output keeps `h`
as its minor axis (as `Xq^T` times the digits, an `(E, h, 4)` int32 output, its minor axis
of 4 padded to 128 by the tiled layout, took 128 MiB at `h = 2048`).

The two dX terms of two-way EC, `eps * (Wq_e 1_D)` and `(a - m)_(b, e) Wq_e^T` of every row,
are one float32 ragged product (`structured_dx`) of the rows `[eps, one-hot of the example]`
with every expert's `(1 + B, h)` matrix of its row sums and its segments' channel terms. The
reference gathers both per row (`rw[expert]`, `v[segment]`): XLA:TPU runs a gather as its own
kernel and writes an `(n, h)` float32 array for each; the row sums' gather depends only on
the weights and the routing, so XLA computes it early and keeps it until the dX correction.
The product writes one such array, after the statistics it needs; dX-only EC's term
`eps * (Wq_e 1_D)` is the same product of the rows `eps` alone (`token_dx`). (Under `d_out`
sharding both take this shard's block of `Wq`, and the engine subtracts them from this
shard's partial dX before the sum of dX over the shards, chunk by chunk: below.)

**An expert GEMM's outputs in chunks of rows.** XLA:TPU writes an expert GEMM's int32
result, its float32 rescaling and, where the features are split over `tp`, their sum over
the shards as arrays of the output's size (at Table IV's 262144 rows per shard and a width
of 2048: 2 GiB each); it runs the gather of every row's weight scales `s_w[expert]` in the
rescaling of `Y` as its own kernel, writing one more; and the dX terms of the error
correction are one more, alive beside the partial dX until the subtraction. The backward's
scale-folded gradient `G' = s_x G s_w` is a float32 array of that size too, and the gather
of every row's `s_w[expert]` that forms it another. So an expert GEMM computes `Y`, dX
with its correction, and in the backward the passes over `G'` (`max|G'|`, the codes, the
row sums of `E`; each forms `G'` again from the chunk of `G`, the engine's `_Folded`) in
chunks of at most `ROW_CHUNK` rows (`row_chunks`, a loop whose chunks XLA writes in place
into one output array, made with the loop; the engine's `AbstractLayer.over_rows` and `by_rows`):
per chunk the GEMM over the chunk's group sizes, the
rescaling or the correction, the sum over the `tp` shards, and the cast to x's dtype (the
engine's `backward` divides dX by `s_x` and casts it by rows, so the loop writes bfloat16
for bfloat16 activations: 1 GiB at 262144 x 2048 rather than float32's 2). Each chunk reads every
expert's weights (`E h d` int8, 96 MiB per `tp` shard of Qwen3-30B-A3B's `up` GEMM), eight
times per GEMM at 262144 rows: a cost the compile's memory figures do not show, not timed
on a TPU.

Measured with `benchmarks/tpu_moe_layer.py --mode shard_map_tp --policies
rtne,s3r,s3r-ec-dx,s3r-ec-2way --packing [--kernels reference]` (Qwen3-30B-A3B's expert
GEMMs laid out as Table IV's step: v5p 2x2x1 as `data=2 x tp=2`, 262144 rows per `data`
shard, `up` `(n, 2048) @ (128, 2048, 768)` column-parallel (`d_out = tp`), `down`
`(n, 768) @ (128, 768, 2048)` row-parallel (`d_in = tp`), as the FFN), MiB per chip,
temporaries / XLA's peak / the most bytes live at one instruction (`BufferPacking.live`):

| forms (`--kernels`) | policy | up | down |
| --- | --- | --- | --- |
| reference | RTNE | 3444 / 6034 / 2833 | 4823 / 8019 / 4818 |
| reference | S3R | 3444 / 6034 / 2833 | 4408 / 7412 / 4211 |
| reference | dX-only | 5115 / 7923 / 4722 | 4200 / 7398 / 4197 |
| reference | two-way | 7510 / 9703 / 6502 | 4749 / 7402 / 4201 |
| these (`auto`) | S3R (= RTNE) | 2916 / 6018 / 2817 | 2230 / 5364 / 2163 |
| these (`auto`) | dX-only | 2916 / 6018 / 2817 | 2502 / 5508 / 2307 |
| these (`auto`) | two-way | 3273 / 6375 / 3174 | 3919 / 6031 / 2830 |

The chunks take the largest arrays out of every policy's peak (the `down` GEMM's forward
holds its int32 result, the sum over `tp` and the gathered scales at once, its backward
`G'` and the gathered scales: -2048 MiB on S3R's peak) and the dX terms out of the error
corrections' (dX-only needs nothing over S3R on the `up` peak, where all rows' terms needed
+1889; two-way +357, where they needed +3669); where the live bytes drop, XLA's packing may
still leave holes (`temporaries` counts a hole twice, the compile guide's packing section):
S3R's `down` GEMM has 34 MiB of them, two-way EC's 545. (Forming `G'` chunk by chunk in
the backward took S3R's `down` GEMM from 5638 MiB of temporaries and a peak of 5764 to
2230 and 5364, two-way EC's from 6383 and 6623 to 3919 and 6031, and dX-only's `up` GEMM
from 3461 and 6083 to S3R's; `xq_sums` as one contraction took the `up` GEMM's two-way
temporaries from 3532 to 3275 MiB and its peak from 6566 to 6375.)

XLA:TPU computes a ragged contraction (contracting the rows) as a masked convolution over
all experts, and besides the `(E, rows)` mask it uses it writes an `(E, rows, 1)` boolean
one (only a scheduling dependency) that its tiled layout pads to `128 E rows` bytes: 2 GiB
at 131072 rows and 128 experts. `segment_sums` and `xq_sums` therefore contract at most
`SEGMENT_CHUNK` rows at a time, as the dW GEMM does (`_gemms.ragged_token_contraction`,
`DW_CHUNK`): a chip of Table IV's Qwen3-30B-A3B step holds 262144 expert rows (its
`s32[262144, 2048]` buffers), where one unchunked segment sum's mask would take 4 GiB.

**The expert dW in the weights' layout** (`ragged_dw`). XLA:TPU lays out a parameter
`(..., h, d)` with `h` minor where `d` is not a multiple of 128 and `h` is (`h_minor`; it
pads less), and writes a ragged contraction's output row-major. In a training step whose
layers run as one `jax.lax.scan`, the stacked weight gradients leave the scan in the layout
of the dW GEMM's output: where it is not the parameters', the compiler copies the whole stack
of weights into the scan and of gradients out of it, alive through the step
(DeepSeek-V2-Lite's gate and up experts, `(64, 2048, 704)` per `tp` shard: float32 copies
of the 26 MoE layers' stacks; `tests/test_tpu.py` shows them on a small step). So where `h` is
minor the dW GEMM is `(Q_e^T Xq_e)^T`, written in the parameters' layout (the same integer
sums). Table IV's DeepSeek-V2-Lite step (`benchmarks/tpu_compile.py`, 1-layer cut, 4
sequences per chip) drops from 14.796 to 14.546 GiB of temporaries for S3R and RTNE
(two-way EC's dW correction wrote the gradient in the parameters' layout already: 15.274
before and after); at its 27 layers and 1 sequence per chip (`--parts full`) every INT8
policy compiles with about 2 GiB of temporaries, where the compiler refused RTNE, S3R and
dX-only EC before. Qwen3-30B-A3B's experts (`d = 384`) keep the row-major product.

On XLA:CPU the ragged contractions run masked over all experts, slower than the reference
forms, so CPU runs the reference. The layers choose per backend (`_per_backend`);
`tests/test_kernels_tpu.py` checks that both give the same gradients.

Every function takes and returns local (per-shard) values: the engine adds the shard sums.
"""

import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8, Shaped

from ._gemms import (
    check_sum_terms,
    chunk_group_sizes,
    digit_weights,
    HIGHEST,
    int8_digits,
    ragged,
    ragged_row_chunks,
    ragged_rows,
    ragged_token_contraction,
)


_F32 = jnp.float32
_I32 = jnp.int32


def _examples(example_id: Int[Array, " n"], num_examples: int, dtype) -> Array:
    """The one-hot `(n, examples)` matrix of every row's example."""
    return (example_id[:, None] == jnp.arange(num_examples, dtype=_I32)[None, :]).astype(dtype)


SEGMENT_CHUNK = 2**17
"""Rows per ragged contraction in `segment_sums` (XLA pads its boolean mask to `128 x E x
rows` bytes: 2 GiB at 128 experts)."""

FOLD_CHUNK = 2**16
"""Rows per ragged contraction in `folded_segment_sums`: XLA writes each chunk of `g` to
memory before the contraction reads it."""


def segment_sums(
    v: Shaped[Array, "n ..."],
    example_id: Int[Array, " n"],
    num_examples: int,
    group_sizes: Int[Array, " e"],
) -> Float[Array, "segments ..."]:
    """Sums of the rows of `v` over every `(example, expert)` segment, `example * E +
    expert`, float32 (int8 codes summed exactly in int32): per expert, the rows contracted
    with the one-hot of their example."""
    if v.dtype == jnp.int8:
        check_sum_terms(v.shape[0])
    rows = v.reshape(v.shape[0], -1)
    lhs = _examples(example_id, num_examples, jnp.int8 if v.dtype == jnp.int8 else _F32)
    sums = ragged_row_chunks(lhs, rows, group_sizes, SEGMENT_CHUNK)  # (E, B, c)
    segments = num_examples * group_sizes.shape[0]
    return jnp.swapaxes(sums, 0, 1).reshape(segments, *v.shape[1:])


def _bf16_pieces(v: Float[Array, "..."]) -> list[Array]:
    """`v` as three bfloat16 arrays whose float32 sum is `v` to within `2**-24 |v|` (8
    significand bits each)."""
    pieces = []
    for _ in range(3):
        pieces.append(v.astype(jnp.bfloat16))
        v = v - pieces[-1].astype(_F32)
    return pieces


def _bf16_ragged_rows(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
    """`lhs_e^T rhs_e` of bfloat16 operands for every group of rows, with float32 sums
    (every product of two bfloat16 numbers is exact in float32)."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dn, preferred_element_type=_F32)


def folded_segment_sums(
    g: Float[Array, "n d"],
    shift: Float[Array, ""],
    sx: Float[Array, "n 1"],
    sw: Float[Array, "e 1 d"],
    example_id: Int[Array, " n"],
    num_examples: int,
    group_sizes: Int[Array, " e"],
) -> Float[Array, "segments d"]:
    """The sums over every `(example, expert)` segment of `G' = s_x (g shift) s_w`, read from
    `g` itself: `sw_e * sum_t s_x,t (g_t shift)`, the sums over rows a ragged contraction of
    the one-hot of the examples scaled by `s_x` with `g shift` (`shift` a normal power of
    two, so `g shift` is exact in bfloat16). For bfloat16 `g` the scaled one-hot is cut into
    three bfloat16 pieces (`_bf16_pieces`): a bfloat16 contraction with float32 sums reads
    `g` as it is, where a float32 one would write `g` converted to float32 (and the
    reference, `segment_sums` of `G'`, writes `G'`) to memory."""
    onehot = _examples(example_id, num_examples, _F32) * sx
    if g.dtype == jnp.bfloat16:
        lhs = jnp.concatenate(_bf16_pieces(onehot), axis=1)
        rhs = g * shift.astype(g.dtype)
        parts = ragged_row_chunks(lhs, rhs, group_sizes, FOLD_CHUNK, _bf16_ragged_rows)
        hi, mid, lo = jnp.split(parts, 3, axis=1)  # (E, B, d) each
        sums = hi + mid + lo
    else:
        rhs = g.astype(_F32) * shift
        sums = ragged_row_chunks(onehot, rhs, group_sizes, FOLD_CHUNK)
    sums = sums * sw
    return jnp.swapaxes(sums, 0, 1).reshape(num_examples * group_sizes.shape[0], -1)


EPS_DIGITS = 4
"""Signed base-128 int8 digits of the token means in `xq_sums` (`int8_digits`: within
`2**-24 |eps| + 2**-28 max|eps|`)."""


def xq_sums(
    xq: Int8[Array, "n h"],
    eps: Float[Array, " n"] | None,
    example_id: Int[Array, " n"] | None,
    num_examples: int,
    group_sizes: Int[Array, " e"],
) -> tuple[Float[Array, "e h 1"] | None, Float[Array, "segments h"] | None]:
    """The factors of an expert GEMM's dW terms that read `Xq`, from one int8 ragged
    contraction of the rows of `Xq` (`SEGMENT_CHUNK` at a time, exact int32 sums): `Xq_e^T
    eps_e` of every expert (`None` without `eps`), with `EPS_DIGITS` digits of `eps`
    (`int8_digits`, `eps` as one row) weighted by the digits' weights, and the sums of `Xq`
    over every `(example, expert)` segment (`None` without `example_id`), with the one-hot
    of the example. The rows of `Xq` are the contraction's right operand, so its output
    `(E, digits + B, h)` keeps `h` as its minor axis. (The digits lie in [-64, 64]: a
    chunk's int32 sums stay within `64 * 127 * 2**17 < 2**31`.)"""
    check_sum_terms(xq.shape[0])
    columns, weights = [], None
    if eps is not None:
        digits, scale = int8_digits(eps[None], EPS_DIGITS)  # (digits, 1, n)
        columns.append(digits[:, 0].T)
        weights = scale * digit_weights(EPS_DIGITS)
    if example_id is not None:
        columns.append(_examples(example_id, num_examples, jnp.int8))
    lhs = jnp.concatenate(columns, axis=1)
    sums = ragged_row_chunks(lhs, xq, group_sizes, SEGMENT_CHUNK)  # (E, columns, h)
    token = segments = None
    if weights is not None:
        token = jnp.sum(sums[:, :EPS_DIGITS] * weights[None, :, None], axis=1)[..., None]
    if example_id is not None:
        per_expert = sums[:, sums.shape[1] - num_examples :]  # (E, B, h)
        segments = jnp.swapaxes(per_expert, 0, 1).reshape(-1, xq.shape[1])
    return token, segments


def token_dx(
    eps: Float[Array, " n"], rw: Float[Array, "e h"], group_sizes: Int[Array, " e"]
) -> Float[Array, "n h"]:
    """`eps * rw[expert]` of every row, dX-only EC's term, as a float32 ragged product of the
    rows `eps` `(n, 1)` with every expert's row sums `(1, h)`."""
    return ragged(eps[:, None], rw[:, None, :], group_sizes, ((1,), (1,)), True)


def _replicated(v: Float[Array, "n ..."]) -> Float[Array, "n ..."]:
    """`v` itself, written as the product of an identity matrix with `v` (exact: float32 at
    `HIGHEST`): where `v`'s rows are split over chips by `jax.jit` sharding, the SPMD
    partitioner computes it as the sum over the chips of their zero-padded blocks (an
    all-reduce of `v`'s size), so every chip holds all of `v`."""
    eye = jnp.eye(v.shape[0], dtype=_F32)
    return jnp.tensordot(eye, v, axes=1, precision=HIGHEST)


def token_operands(xq: Int8[Array, "b s h"], eps: Float[Array, "b s"]) -> tuple[Array, Array]:
    """`(xq, eps)`, neither before both exist (`jax.lax.optimization_barrier`), the operands
    of a dense layer's token product `Xq^T eps`: the product then reads the int8 codes once
    `eps` exists. Without it, XLA:TPU may fuse the quantizer that makes `Xq` into the
    product and quantize the layer's input again there, keeping that float input from the
    forward to the backward (the module's docstring)."""
    eps, xq = jax.lax.optimization_barrier((eps, xq))
    return xq, eps


def after(v: Array, q: Array) -> Array:
    """`v`, to be read only once the codes `q` exist (`jax.lax.optimization_barrier`): a
    value that depends on the weights alone, such as the row sums `Wq 1_D` of dX's token
    term, would otherwise be computed in the forward, right after `Wq`, and kept across the
    rest of the forward and the backward of the later layers."""
    return jax.lax.optimization_barrier((v, q))[0]


def sum_first(token: Array | None, segments: tuple, codes: tuple) -> tuple:
    """The factors of a dense layer's dW terms summed over the chips before the GEMMs: the
    token term `Xq^T eps` as it is (the partitioner sums its partial products), the
    per-example factors `(Xq sums, a - m)` of the channel term on every chip
    (`_replicated`), all tied to the codes with `jax.lax.optimization_barrier`, so the GEMMs
    (and the backward of the layers after this one) wait for these sums and XLA's all-reduce
    combiner cannot merge them with the dW all-reduces of later layers. The channel term is
    then the product of the whole factors on every chip, where the sum over the chips of
    its partial products would be one more all-reduce, of the weight's size."""
    segments = tuple(_replicated(v) for v in segments)
    return jax.lax.optimization_barrier((token, segments, codes))


def together(dx: Array, dw: Array) -> tuple[Array, Array]:
    """`(dx, dw)`, neither before both exist (`jax.lax.optimization_barrier`): the layers
    below this one run their backward only once this layer's dW, its sum over the chips and
    its error correction are done, so the factors of the correction and the checks' flags do
    not live on to the end of the backward (the module's docstring)."""
    return jax.lax.optimization_barrier((dx, dw))


def structured_dx(
    eps: Float[Array, " n"],
    rw: Float[Array, "e h"],
    v: Float[Array, "segments h"],
    example_id: Int[Array, " n"],
    num_examples: int,
    group_sizes: Int[Array, " e"],
) -> Float[Array, "n h"]:
    """`eps * rw[expert] + v[example * E + expert]` of every row, both error-correction
    terms of dX in one float32 ragged product: the rows `[eps, one-hot of the example]`
    `(n, 1 + B)` against every expert's `[rw_e; v_(0, e); ...; v_(B-1, e)]` `(1 + B, h)`."""
    E = group_sizes.shape[0]
    per_expert = jnp.swapaxes(v.reshape(num_examples, E, -1), 0, 1)  # (E, B, h)
    rhs = jnp.concatenate([rw[:, None, :], per_expert], axis=1)
    lhs = jnp.concatenate([eps[:, None], _examples(example_id, num_examples, _F32)], axis=1)
    return ragged(lhs, rhs, group_sizes, ((1,), (1,)), True)


TILE = 128
"""The minor tile width of XLA:TPU's layouts (`T(8,128)` for float32, `T(32,128)` for int8)."""


def h_minor(h: int, d: int) -> bool:
    """Whether XLA:TPU's default layout of an `(..., h, d)` array puts `h` minor: where `d`
    is not a multiple of `TILE` and `h` is (`(64, 1024, 704)` is laid out `{1,2,0}`),
    which pads less. The compiler picks that layout for a model's parameters, so it is the
    layout of their gradients when they leave the layers' scan (`tests/test_tpu.py` checks
    this rule against the compiler)."""
    return d % TILE != 0 and h % TILE == 0


def ragged_dw(
    xq: Int8[Array, "n h"], q: Shaped[Array, "n d"], group_sizes: Int[Array, " e"]
) -> Float[Array, "e h d"]:
    """`Xq_e^T Q_e` for every expert, the expert GEMM's dW, computed in the orientation of
    the weight's default layout (`h_minor`): as `(Q_e^T Xq_e)^T` where `h` is minor, so the
    product writes the gradient in the parameters' layout, and the compiler copies no stack
    of weights or gradients around the layers' scan (the module's docstring). Integer sums
    are exact in either orientation; float32 ones may differ in their order."""
    if not h_minor(xq.shape[1], q.shape[1]):
        return ragged_token_contraction(xq, q, group_sizes)
    swapped = lambda a, b, gs: jnp.swapaxes(ragged_rows(b, a, gs), 1, 2)
    return ragged_token_contraction(xq, q, group_sizes, swapped)


ROW_CHUNK = 2**15
"""The most rows per chunk of an expert GEMM's output (`row_chunks`): `2**15 x 2048` float32
is 256 MiB."""


def row_chunk(n: int) -> int:
    """The rows per chunk of an expert GEMM's output of `n` rows: the largest divisor of `n`
    not above `ROW_CHUNK`, or `n` (one chunk) where every such divisor is below
    `ROW_CHUNK / 8` (more chunks, each reading every expert's weights, for a small gain)."""
    parts = -(-n // ROW_CHUNK)
    while 8 * n >= ROW_CHUNK * parts:
        if n % parts == 0:
            return n // parts
        parts += 1
    return n


def row_chunks(
    fn: Callable[[Callable[[Array], Array], Array], typing.Any],
    n: int,
    group_sizes: Int[Array, " e"],
) -> typing.Any:
    """`fn(take, sizes)`, values of some rows of an expert GEMM computed from `take` (which
    cuts those rows out of an array over all `n` rows) and their group sizes `sizes`, for
    every chunk of `c = row_chunk(n)` rows, every leaf stacked over the chunks on a new
    leading axis: a loop over the chunks writes each chunk's values in place into one array
    per leaf (with one chunk, `c = n`, a loop of one step).

    The loop starts at a chunk XLA cannot compute at compile time (chunk 0, behind
    `jax.lax.optimization_barrier`), so XLA cannot prove that it overwrites the whole
    output: where it can, XLA:TPU allocates that output as an `AllocateBuffer`, which
    depends on nothing, and scheduled it at the start of the layer's backward (in Table IV's
    DeepSeek-V2-Lite step, the `down` GEMM's gradient codes, 384 MiB per chip, held through
    the recomputed forward). Here the output is a zeros array made beside the loop, which
    costs one write of it."""
    c = row_chunk(n)
    k = n // c

    def chunk(lo):
        take = lambda v: jax.lax.dynamic_slice_in_dim(v, lo, c)
        return fn(take, chunk_group_sizes(group_sizes, lo, lo + c))

    first = jax.lax.optimization_barrier(jnp.zeros((), _I32))

    def step(i, out):
        i = (first + i) % k
        values = chunk(i * c)
        return jax.tree.map(
            lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), out, values
        )

    out = jax.tree.map(lambda v: _zeros((k, *v.shape), v), jax.eval_shape(chunk, first))
    return jax.lax.fori_loop(0, k, step, out)


def _zeros(shape: tuple[int, ...], like: jax.ShapeDtypeStruct) -> Array:
    """Zeros of `shape` and `like`'s dtype, varying over the mesh axes `like` varies over
    inside `jax.shard_map` (a loop's output must have its values' type)."""
    zeros = jnp.zeros(shape, like.dtype)
    manual = like.manual_axis_type
    axes = () if manual is None else tuple(manual.varying)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros
