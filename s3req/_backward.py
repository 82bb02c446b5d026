"""One quantized matmul for dense layers and expert GEMMs: forward, backward and error
correction, as DESIGN.md section 3 writes them.

A [`Dense`][] layer is the GEMM `(b, s, h) @ (h, d)` of `qdot`; a [`Ragged`][] layer is the
expert GEMM of `qragged_dot`: `(n, h)` rows sorted by expert, expert `e` multiplying its rows
by `w[e]`. Both are described by the same few operations (`AbstractLayer`): the three GEMMs,
and the sums over the rows of a *segment*, the unit the error correction averages over (an
example of a dense layer, an `(example, expert)` segment of an expert GEMM). `forward` and
`backward` are written once against them, for every topology, format and correction.

This is the reference path: plain reductions, segment sums and float32 products. Backend
kernels compute some of the same quantities in forms one compiler handles better
(`_kernels_cpu.py` for XLA:CPU, `_kernels_tpu.py` for XLA:TPU, `_kernels_gpu.py` for
XLA:GPU on CUDA); a layer chooses them per
backend when the program is lowered (`jax.lax.platform_dependent`, see `_per_backend`). The
integer GEMMs themselves are shared (`_gemms.py`).
"""

import abc
import copy
import functools as ft
import typing
from collections.abc import Callable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jaxtyping import Array, Int, PRNGKeyArray

from . import _kernels_cpu, _kernels_gpu, _kernels_tpu
from ._gemms import (
    check_sum_terms,
    dot as _dot,
    DW_CHUNK as DW_CHUNK,
    HIGHEST as _HIGHEST,
    MAX_TERMS as MAX_TERMS,
    ragged as _ragged,
    ragged_token_contraction as _ragged_token_contraction,
    token_contraction as _token_contraction,
)
from ._interfaces import AbstractCorrection, AbstractErrorTerms, AbstractPolicy
from ._quantize import (
    finite_absmax,
    normalizing_shift,
    pow2,
    QMAX,
    round_to_int8,
    SCALE_EXPONENT,
    shifted_scale,
    unshift,
)
from ._sharding import ShardAxes
from ._thresholds import Layout, Rows


_F32 = jnp.float32
_I32 = jnp.int32
_T = typing.TypeVar("_T")

KERNELS: Literal["auto", "reference", "cpu", "tpu", "cuda"] = "auto"
"""Which implementations are traced: `"auto"` chooses per backend when lowering (a backend's
kernel where the layer has one, the reference elsewhere); the others force the reference or
one backend's kernels on every backend (for tests that compare them)."""


def _per_backend(
    reference: Callable,
    *args,
    cpu: Callable | None = None,
    tpu: Callable | None = None,
    cuda: Callable | None = None,
) -> typing.Any:
    """`reference(*args)`, or `cpu(*args)` / `tpu(*args)` / `cuda(*args)` in programs
    lowered for that backend (see `KERNELS`); all return the same pytree of arrays."""
    kernels = {"cpu": cpu, "tpu": tpu, "cuda": cuda}
    if KERNELS != "auto":
        return (kernels[KERNELS] or reference)(*args) if KERNELS in kernels else reference(*args)
    branches = {name: k for name, k in kernels.items() if k is not None}
    if not branches:
        return reference(*args)
    return jax.lax.platform_dependent(*args, default=reference, **branches)


# --- sums (the GEMMs are in `_gemms.py`) ---------------------------------------------------


def _sum(v: Array, axis: int) -> Array:
    """Sum of codes along `axis` (int8 summed exactly in int32) or of floats, as float32."""
    if v.dtype != jnp.int8:
        return jnp.sum(v, axis=axis, dtype=_F32)
    check_sum_terms(v.shape[axis])
    return jnp.sum(v, axis=axis, dtype=_I32).astype(_F32)


def _segment_sum(v: Array, segment: Array, segments: int) -> Array:
    """Sums of the rows of `v` with the same `segment` id, `(segments, *rest)`, as float32
    (int8 codes summed exactly in int32)."""
    if v.dtype == jnp.int8:
        check_sum_terms(v.shape[0])
        v = v.astype(_I32)
    return jax.ops.segment_sum(v, segment, segments).astype(_F32)


def _rows_of_chunks(chunks: _T) -> _T:
    """Values over the rows from the same values of every chunk of rows, stacked over the
    chunks (`AbstractLayer.over_rows`)."""
    return jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), chunks)


# --- the two layer kinds --------------------------------------------------------------------


class AbstractLayer(eqx.Module):
    """What `forward` and `backward` need to know about a layer kind.

    "Rows" are the tokens of the activations and of the gradient (`(b, s)` for a dense layer,
    `(n,)` for an expert GEMM), channels last. A *segment* is the set of rows the error
    correction averages over. Every method returns this shard's values; `backward` adds the
    shard sums named by `ShardAxes` roles.
    """

    axes: eqx.AbstractVar[ShardAxes]
    name: eqx.AbstractClassVar[str]
    segment_roles: eqx.AbstractClassVar[tuple]
    """The roles whose shards split the rows of one segment."""

    @abc.abstractmethod
    def error_sums(self, errors: _T, codes: _T, segments: bool) -> _T:
        """The sums of `E` over the channels of every row and over the rows of every segment,
        `(rows, segments)`: `errors` (`E` formed inside the sums, the reference) or, in the
        programs of a backend whose kernel sums the codes and `G'` apart, `codes` (both are
        traced; the program keeps one). `segments` says whether the correction uses the
        segment sums; where it does not, only the row sums reach the program."""

    @abc.abstractmethod
    def weight_absmax(self, w: Array) -> Array:
        """Per-output-channel `max|w|` (keeping the contracted axis, size 1; see
        `finite_absmax`)."""

    @abc.abstractmethod
    def gemm(self, xq: Array, wq: Array) -> Array:
        """The forward GEMM `Xq Wq` (int32, this shard's partial sums over `d_in`)."""

    @abc.abstractmethod
    def row_scales(self, sw: Array) -> Array:
        """`s_w` of every row's output channels, broadcastable to the output."""

    @abc.abstractmethod
    def fold(self, g: Array, sx: Array, sw: Array) -> Array:
        """`G' = s_x G s_w` in float32."""

    @abc.abstractmethod
    def folded_segment_sums(
        self, gp: Array, g: Array, shift: Array, sx: Array, sw: Array
    ) -> Array:
        """`segment_sums(gp)` of `gp = fold(g * shift, sx, sw)`, which a kernel may compute
        from the fold's inputs (`shift` a power of two)."""

    @abc.abstractmethod
    def layout(self, gp: Array) -> Layout:
        """The part of the global gradient that `gp` is (for the thresholds)."""

    @abc.abstractmethod
    def gemm_dx(self, q: Array, wq: Array) -> Array:
        """`Q Wq^T` (float32)."""

    @abc.abstractmethod
    def over_rows(
        self,
        fn: Callable[["AbstractLayer", Callable[[Array], Array]], _T],
        combine: Callable[[_T], _T],
    ) -> _T:
        """`fn(part, take)`, which computes values of the rows of `part` (this layer
        restricted to some rows; `take` cuts those rows out of an array over all rows): for
        all rows at once (`part` this layer, `take` the identity), or, in the programs of a
        backend whose kernel does so, for every chunk of rows, then `combine` of those
        values, every leaf stacked over the chunks on a new leading axis (a pytree like
        the one of all rows at once)."""

    def by_rows(self, fn: Callable[["AbstractLayer", Callable[[Array], Array]], _T]) -> _T:
        """Outputs over the rows (`Y`, dX, the row sums of `E`) from `fn(part, take)`
        (`over_rows`), for
        all rows at once or chunk by chunk into one array."""
        return self.over_rows(fn, _rows_of_chunks)

    @abc.abstractmethod
    def gemm_dw(self, xq: Array, q: Array) -> Array:
        """`Xq^T Q` (float32, exact for int8 codes)."""

    @abc.abstractmethod
    def weight_gradient(self, dw: Array, sw: Array) -> Array:
        """`dW / s_w` in the weight's layout."""

    @abc.abstractmethod
    def row_sums(self, v: Array) -> Array:
        """Sums over the channels of every row of the codes or of `G'` (float32). (Those of
        `E` are reductions formed with `E`, `_ErrorTerms._error_sums`.)"""

    @abc.abstractmethod
    def segment_sums(self, v: Array) -> Array:
        """Sums over the rows of every segment, `(segments, *rest)` (float32)."""

    @abc.abstractmethod
    def segment_tokens(self, q: Array) -> Array | int:
        """The number of rows of every segment over all shards, broadcastable against
        `(segments,)` (empty segments count 1); `q` is this shard's codes of the gradient."""

    @abc.abstractmethod
    def weight_row_sums(self, wq: Array, q: Array) -> Array:
        """`Wq 1_D` of every expert (float32); `q` the codes of the upstream gradient, after
        which a kernel may take the sums (they depend on the weights alone)."""

    @abc.abstractmethod
    def token_dx(self, eps: Array, rw: Array) -> Array:
        """`eps * (Wq 1_D)` of every row, its token mean times the row sums `rw`
        (`weight_row_sums`, all shards) of its expert, broadcastable to `(rows, h)`."""

    @abc.abstractmethod
    def channel_dx(self, am: Array, wq: Array) -> Array:
        """`(a - m) Wq^T` of every segment."""

    @abc.abstractmethod
    def segment_dx(self, v: Array) -> Array:
        """The values `v` of every segment (`channel_dx`, all shards) for every row,
        broadcastable to `(rows, h)`."""

    @abc.abstractmethod
    def structured_dx(self, eps: Array, rw: Array, v: Array) -> Array:
        """`token_dx(eps, rw) + segment_dx(v)`: both dX terms of every row."""

    @abc.abstractmethod
    def xq_sums(self, xq: Array, eps: Array | None, segments: bool) -> tuple:
        """The factors of the dW terms that read `Xq`, `(token, xsum)`: `Xq^T eps` of every
        expert, broadcastable to the shape of dW (`None` without `eps`), and the sums of
        `Xq` over the rows of every segment (`segment_sums`; `None` unless `segments`). A
        kernel may compute both in one pass over `Xq`."""

    @abc.abstractmethod
    def channel_dw(self, xsum: Array, am: Array) -> Array:
        """`sum over segments of xsum (a - m)^T` of every expert, the shape of dW."""

    @abc.abstractmethod
    def sum_first(self, token: Array | None, segments: tuple, codes: tuple) -> tuple:
        """`(token, segments, codes)`: the factors of the dW terms (`Xq^T eps` of `xq_sums`, the
        per-segment `(xsum, a - m)` of `channel_dw`) and the codes of the GEMMs, or, in the
        programs of a backend whose kernel does so, the same values with the factors summed
        over the chips before the GEMMs read the codes (see `_ErrorTerms.sum_factors_first`)."""

    @abc.abstractmethod
    def together(self, dx: Array, dw: Array) -> tuple[Array, Array]:
        """`(dx, dw)` of a backward pass whose dW has error-correction terms, as the layer
        hands them on: as they are, or, in the programs of a backend whose kernel does so,
        neither before both exist (so the dW terms' factors are not kept until the end of
        the backward; `_kernels_tpu.together`)."""


@typing.final
class Dense(AbstractLayer):
    """`qdot`'s layer: `x (b, s, h) @ w`, `w` stored `(h, d)` or, `transposed`, `(d, h)`.
    Segments are the examples.

    The products of the error means with `Wq`, `Xq` and the code sums are float32 products
    (`HIGHEST`: TPU's default precision would round the means to bf16). XLA:TPU reads the
    int8 operand of an `f32 x s8` product as it is; on XLA:CPU they run on int8 digits of
    the means (`_kernels_cpu.digits_dot`). On TPU the factors of the dW terms are summed
    over the chips before the GEMMs (`_kernels_tpu.sum_first`), `Xq^T eps` read from the
    codes (`_kernels_tpu.token_operands`), the row sums `Wq 1_D`
    taken once the codes exist (`_kernels_tpu.after`), and where dW has error-correction
    terms dX is handed on only once dW exists (`_kernels_tpu.together`). On CUDA the dX GEMM
    reads its codes as plain operands (`_kernels_gpu.plain_operands`), outside `shard_map`.
    """

    axes: ShardAxes = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)
    name: typing.ClassVar[str] = "s3req.qdot"
    segment_roles: typing.ClassVar[tuple] = ("seq",)

    @property
    def _h_axis(self) -> int:  # the axis of w holding d_in; the other holds d_out
        return 1 if self.transposed else 0

    @property
    def _sharded(self) -> bool:  # inside `shard_map` (`ShardAxes` names mesh axes)
        return bool(self.axes.names("batch", "seq", "d_in", "d_out"))

    def error_sums(self, errors, codes, segments):
        return _per_backend(lambda e, c: e, errors, codes, cpu=lambda e, c: c)

    def weight_absmax(self, w):
        return finite_absmax(w, axis=self._h_axis, keepdims=True)

    def gemm(self, xq, wq):
        return _dot(xq, wq, ((2,), (self._h_axis,)))

    def row_scales(self, sw):
        return sw.reshape(1, 1, -1)

    def fold(self, g, sx, sw):
        sw = sw.reshape(-1)
        return _per_backend(
            lambda g, sx, sw: sx * g.astype(_F32) * sw[None, None, :],
            g,
            sx,
            sw,
            cpu=_kernels_cpu.fold_scales,
        )

    def folded_segment_sums(self, gp, g, shift, sx, sw):
        return self.segment_sums(gp)

    def layout(self, gp):
        B, S, D = gp.shape
        return self.axes.block((B, S, D))

    def gemm_dx(self, q, wq):
        # Inside `shard_map` one barrier over both would make `wq` vary over the codes' mesh
        # axes too (its outputs share their inputs' manual axes).
        cuda = None if self._sharded else _kernels_gpu.plain_operands
        q, wq = _per_backend(lambda q, wq: (q, wq), q, wq, cuda=cuda)
        return _dot(q, wq, ((2,), (1 - self._h_axis,))).astype(_F32)

    def over_rows(self, fn, combine):
        return fn(self, lambda v: v)

    def gemm_dw(self, xq, q):
        return _token_contraction(xq, q)

    def weight_gradient(self, dw, sw):
        dw = dw / sw.reshape(1, -1)
        return dw.T if self.transposed else dw  # in the weight's layout, inside the rescaling

    def row_sums(self, v):
        return _per_backend(lambda v: _sum(v, 2), v, cpu=lambda v: _kernels_cpu.sums(v, 2))

    def segment_sums(self, v):
        if v.ndim == 2:  # per-row values, e.g. eps
            return jnp.sum(v, axis=1)
        return _per_backend(lambda v: _sum(v, 1), v, cpu=lambda v: _kernels_cpu.sums(v, 1))

    def segment_tokens(self, q):
        return q.shape[1] * self.axes.size("seq")

    def weight_row_sums(self, wq, q):
        d_axis = 1 - self._h_axis
        tpu = lambda wq, q: _sum(_kernels_tpu.after(wq, q), d_axis)[None, None, :]
        return _per_backend(
            lambda wq, q: _sum(wq, d_axis)[None, None, :],
            wq,
            q,
            cpu=lambda wq, q: _kernels_cpu.weight_row_sums(wq, d_axis),
            # Inside `shard_map` the codes vary over more mesh axes than `wq` does.
            tpu=None if self._sharded else tpu,
        )

    def token_dx(self, eps, rw):
        return eps[..., None] * rw

    def channel_dx(self, am, wq):
        d_axis = 1 - self._h_axis
        return _per_backend(
            lambda am, wq: _dot(am, wq, ((1,), (d_axis,)), precision=_HIGHEST)[:, None, :],
            am,
            wq,
            cpu=lambda am, wq: _kernels_cpu.channel_dx(am, wq, d_axis),
        )

    def segment_dx(self, v):
        return v

    def structured_dx(self, eps, rw, v):
        return self.token_dx(eps, rw) + v

    def xq_sums(self, xq, eps, segments):
        token = None
        if eps is not None:
            product = lambda xq, eps: _dot(eps, xq, ((0, 1), (0, 1)), precision=_HIGHEST)[:, None]
            token = _per_backend(
                product,
                xq,
                eps,
                cpu=_kernels_cpu.token_dw,
                # Inside `shard_map` one barrier over both would make `eps` vary over the
                # codes' mesh axes.
                tpu=None
                if self._sharded
                else lambda xq, eps: product(*_kernels_tpu.token_operands(xq, eps)),
            )
        return token, self.segment_sums(xq) if segments else None

    def channel_dw(self, xsum, am):
        return _per_backend(
            lambda xsum, am: _dot(xsum, am, ((0,), (0,)), precision=_HIGHEST),
            xsum,
            am,
            cpu=_kernels_cpu.channel_dw,
        )

    def sum_first(self, token, segments, codes):
        if self._sharded:  # `backward` adds the shard sums
            return token, segments, codes
        return _per_backend(lambda *v: v, token, segments, codes, tpu=_kernels_tpu.sum_first)

    def together(self, dx, dw):
        if self._sharded:  # the dW terms are added before the shard sum
            return dx, dw
        return _per_backend(lambda *v: v, dx, dw, tpu=_kernels_tpu.together)


@typing.final
class Ragged(AbstractLayer):
    """`qragged_dot`'s layer: rows `x (n, h)` sorted by expert (`group_sizes`), `w (E, h, d)`.
    Segments are the `(example, expert)` pairs, `example * E + expert`.

    Inside `jax.shard_map` the `batch`/`seq` roles split the rows (each shard holds its own
    rows, `group_sizes`, and their global ids), `d_in` and `d_out` the features.

    The segment sums and `Xq_e^T eps_e` are `jax.ops.segment_sum`s here and the dX terms of
    the error correction gathers of per-expert and per-segment values; on TPU the sums run as
    ragged contractions (those of `E` as the sums of the codes minus those of `G'`, read from
    the upstream gradient) and both dX terms as one ragged product, and `Y`, dX (with its
    correction) and the backward's passes over `G'` (`max|G'|`, the codes, the row sums of
    `E`; `_Folded`) are computed in chunks of rows (`over_rows`; `_kernels_tpu.py`). On CPU
    the three GEMMs read the codes as plain GEMM operands (`_kernels_cpu.ragged_gemm`,
    `ragged_rows`): XLA:CPU has no grouped GEMM; and a correction that uses no segment sum
    (dX-only) takes the row sums of `E` from the codes and `G'` apart, as dots
    (`_kernels_cpu.sums`; see `error_sums`).
    """

    group_sizes: Int[Array, " e"]
    row_id: Int[Array, " n"]
    example_id: Int[Array, " n"]
    axes: ShardAxes = eqx.field(static=True)
    num_examples: int = eqx.field(static=True)
    name: typing.ClassVar[str] = "s3req.qragged_dot"
    segment_roles: typing.ClassVar[tuple] = ("batch", "seq")

    @property
    def _experts(self) -> int:
        return self.group_sizes.shape[0]

    @property
    def _expert(self) -> Int[Array, " n"]:  # the expert of every row
        E, n = self._experts, self.row_id.shape[0]
        return jnp.repeat(jnp.arange(E, dtype=_I32), self.group_sizes, total_repeat_length=n)

    @property
    def _segment(self) -> Int[Array, " n"]:
        return self.example_id * self._experts + self._expert

    @property
    def _segments(self) -> int:
        return self.num_examples * self._experts

    def error_sums(self, errors, codes, segments):
        # On TPU the segment sums from the codes and `G'` apart: those of `G'` read the
        # upstream gradient (`folded_segment_sums`) where those of `E` write `E` to memory.
        # On CPU the sums of `E`, formed once for both, where the segment sums are used; the
        # row sums alone from the codes and `G'` (dots, `row_sums`): as a reduction of `E`,
        # XLA:CPU fuses them into the dX correction, whose broadcast operands it then writes
        # to memory at the gradient's size.
        return _per_backend(
            lambda e, c: e,
            errors,
            codes,
            cpu=(lambda e, c: e) if segments else (lambda e, c: c),
            tpu=lambda e, c: (e[0], c[1]),
        )

    def weight_absmax(self, w):
        return finite_absmax(w, axis=1, keepdims=True)

    def _gemm(self, lhs: Array, wq: Array, axis: int) -> Array:
        """The rows `lhs` times their expert's `wq`, contracting `wq`'s axis `axis`."""
        gs = self.group_sizes
        return _per_backend(
            lambda lhs, wq: _ragged(lhs, wq, gs, ((1,), (axis,)), True),
            lhs,
            wq,
            cpu=lambda lhs, wq: _kernels_cpu.ragged_gemm(lhs, wq, gs, axis),
        )

    def gemm(self, xq, wq):
        return self._gemm(xq, wq, 1)

    def row_scales(self, sw):
        return sw[:, 0, :][self._expert]

    def fold(self, g, sx, sw):
        return sx * g.astype(_F32) * self.row_scales(sw)

    def folded_segment_sums(self, gp, g, shift, sx, sw):
        B, example, gs = self.num_examples, self.example_id, self.group_sizes
        return _per_backend(
            lambda gp, g, shift, sx, sw: self.segment_sums(gp),
            gp,
            g,
            shift,
            sx,
            sw,
            tpu=lambda gp, g, shift, sx, sw: _kernels_tpu.folded_segment_sums(
                g, shift, sx, sw, example, B, gs
            ),
        )

    def layout(self, gp):
        d = gp.shape[-1]
        start = self.axes.index("d_out") * d
        return Rows(self.row_id, self.example_id, d, start, d * self.axes.size("d_out"))

    def gemm_dx(self, q, wq):
        return self._gemm(q, wq, 2).astype(_F32)

    def over_rows(self, fn, combine):
        def part(take, sizes):
            rows = dict(row_id=take(self.row_id), example_id=take(self.example_id))
            return fn(
                Ragged(group_sizes=sizes, **rows, axes=self.axes, num_examples=self.num_examples),
                take,
            )

        n = self.row_id.shape[0]
        whole = lambda: fn(self, lambda v: v)
        if _kernels_tpu.row_chunk(n) == n:  # one chunk: the same program on every backend
            return whole()
        chunks = lambda: combine(_kernels_tpu.row_chunks(part, n, self.group_sizes))
        return _per_backend(whole, tpu=chunks)

    def gemm_dw(self, xq, q):
        gs = self.group_sizes
        return _per_backend(
            lambda xq, q: _ragged_token_contraction(xq, q, gs),
            xq,
            q,
            cpu=lambda xq, q: _ragged_token_contraction(xq, q, gs, _kernels_cpu.ragged_rows),
            tpu=lambda xq, q: _kernels_tpu.ragged_dw(xq, q, gs),
        )

    def weight_gradient(self, dw, sw):
        return dw / sw

    def row_sums(self, v):
        return _per_backend(
            lambda v: _sum(v, 1), v, cpu=lambda v: _kernels_cpu.sums(v[None], 2)[0]
        )

    def segment_sums(self, v):
        segment, segments = self._segment, self._segments
        B, example, gs = self.num_examples, self.example_id, self.group_sizes
        return _per_backend(
            lambda v: _segment_sum(v, segment, segments),
            v,
            tpu=lambda v: _kernels_tpu.segment_sums(v, example, B, gs),
        )

    def segment_tokens(self, q):
        count = self.axes.psum(
            self.segment_sums(jnp.ones(self.row_id.shape, jnp.int8)), *self.segment_roles
        )
        return jnp.maximum(count, 1.0)

    def weight_row_sums(self, wq, q):
        return _sum(wq, 2)

    def token_dx(self, eps, rw):
        gs = self.group_sizes
        return _per_backend(
            lambda eps, rw: eps[:, None] * rw[self._expert],
            eps,
            rw,
            tpu=lambda eps, rw: _kernels_tpu.token_dx(eps, rw, gs),
        )

    def channel_dx(self, am, wq):
        B, E = self.num_examples, self._experts
        per_segment = jnp.einsum(
            "bed,ehd->beh", am.reshape(B, E, -1), wq.astype(_F32), precision=_HIGHEST
        )
        return per_segment.reshape(B * E, -1)

    def segment_dx(self, v):
        return v[self._segment]

    def structured_dx(self, eps, rw, v):
        B, example, gs = self.num_examples, self.example_id, self.group_sizes
        return _per_backend(
            lambda eps, rw, v: self.token_dx(eps, rw) + self.segment_dx(v),
            eps,
            rw,
            v,
            tpu=lambda eps, rw, v: _kernels_tpu.structured_dx(eps, rw, v, example, B, gs),
        )

    def xq_sums(self, xq, eps, segments):
        expert, E, gs = self._expert, self._experts, self.group_sizes
        B, example = self.num_examples, self.example_id if segments else None

        def reference(xq, eps):
            token = None
            if eps is not None:
                token = _segment_sum(xq.astype(_F32) * eps[:, None], expert, E)[..., None]
            return token, self.segment_sums(xq) if segments else None

        return _per_backend(
            reference,
            xq,
            eps,
            tpu=lambda xq, eps: _kernels_tpu.xq_sums(xq, eps, example, B, gs),
        )

    def channel_dw(self, xsum, am):
        B, E = self.num_examples, self._experts
        return jnp.einsum(
            "beh,bed->ehd", xsum.reshape(B, E, -1), am.reshape(B, E, -1), precision=_HIGHEST
        )

    def sum_first(self, token, segments, codes):
        # The expert GEMMs of `models` run inside `shard_map` (`ShardAxes`), where `backward`
        # adds the shard sums after the correction.
        return token, segments, codes

    def together(self, dx, dw):
        return dx, dw


# --- the scale-folded gradient -------------------------------------------------------------


class _Folded:
    """The scale-folded gradient `G' = s_x G s_w` (float32) of one backward pass, formed from
    the fold's inputs `(g, shift, sx, sw)` (`G` times the power of two `shift`).

    `rows(part, take)` is `G'` of the rows of `part` (`AbstractLayer.over_rows`): the whole
    array over all rows, or, for a chunk of rows, formed again from the chunk of the upstream
    gradient. A layer that computes by chunks (the expert GEMMs on TPU) then never holds
    `G'` (nor the scales `s_w` gathered for its rows, as large) over all rows: `max|G'|`,
    the codes and the row sums of `E` each read it chunk by chunk."""

    def __init__(self, layer: AbstractLayer, g: Array, shift: Array, sx: Array, sw: Array):
        self.layer, self.inputs = layer, (g, shift, sx, sw)
        # Formed here, outside the branches `over_rows` may trace (a program that reads `G'`
        # only chunk by chunk does not compute it).
        self.whole = layer.fold(g.astype(_F32) * shift, sx, sw)
        """`G'` over all rows."""

    def rows(self, part: AbstractLayer, take: Callable[[Array], Array]) -> Array:
        """`G'` of the rows of `part`."""
        if part is self.layer:
            return self.whole
        g, shift, sx, sw = self.inputs
        return part.fold(take(g).astype(_F32) * shift, take(sx), sw)

    def absmax(self) -> Array:
        """`max|G'|` over this shard's rows (see `finite_absmax`)."""
        absmax = lambda part, take: finite_absmax(self.rows(part, take))
        return self.layer.over_rows(absmax, lambda chunks: jnp.max(chunks, axis=0))


# --- the error terms ------------------------------------------------------------------------


_SEGMENT_TERMS = frozenset({"dx_channel", "dx_structured", "dw_channel"})
"""The terms that use the segment sums of `E` (the others use only its row sums)."""

_DX_TERMS = frozenset({"dx_token", "dx_channel", "dx_structured"})
"""The terms of dX (`correct_dx` asks for them, for the rows of its dX)."""

_DW_TERMS = frozenset({"dw_token", "dw_channel"})
"""The terms of dW (`correct_dw` asks for them)."""


class _ErrorTerms(AbstractErrorTerms):
    """The error terms of one backward pass, each computed when first asked for.

    The statistics are sums of the error `E = Delta Q - G'` over the channels of every row
    and over the rows of every segment. The reference path sums `E` element by element
    (`_error_sums`); the dense layer's CPU kernel sums the codes and `G'` apart (`sum E =
    Delta sum Q - sum G'`, `_code_sums`), and so does the expert GEMM's TPU kernel for the
    segment sums, those of `G'` read from the upstream gradient (`folded_segment_sums`), and
    its CPU kernel for the row sums of a correction that uses no segment sums.
    (`G' / Delta` is clipped to the grid before rounding; only the largest element can be
    clipped, by a float rounding, so the two agree to float precision: to within a few
    roundings of the sums of `|G'|`, where the element sums are within a few of the sums of
    `|E|`.)

    Under `ShardAxes` the statistics (`eps`, `a - m`) are global, added over the shards; the
    terms are this shard's parts, as the GEMM outputs are: those of dX from its `d_out` block
    of `Wq`, those of dW from its rows of `Xq`. `backward` adds the corrected parts.

    The dW terms are formed from factors: `Xq^T eps` (the token term itself, a sum over
    rows) and the per-segment `Xq` sums and `a - m` of the channel term.
    `sum_factors_first` may take them before the GEMMs. The dX terms are formed from `eps`,
    the row sums `Wq 1_D` and the per-segment `(a - m) Wq^T`, taken over all rows; a view
    (`rows`) gives the dX terms of some rows, for a dX computed in chunks of rows.

    `folded` is `G'` (`_Folded`); `asked` the names of the terms the correction asks for
    (`asked_terms`).
    """

    def __init__(
        self,
        layer: AbstractLayer,
        folded: _Folded,
        codes_dx,
        codes_dw,
        xq,
        wq,
        asked: frozenset[str],
    ):
        self.layer, self.folded, self.xq, self.wq = layer, folded, xq, wq
        self.part, self.take = layer, lambda v: v  # the rows of the dX terms (`rows`)
        self.codes = {"dx": codes_dx, "dw": codes_dw}
        self.asked = asked
        self._cache = {}
        self._factors = {}

    def sum_factors_first(self, codes_dx, codes_dw):
        """The codes of the two GEMMs, after the factors of the asked dW terms were
        computed and handed to `layer.sum_first`, which on TPU sums them over the chips
        before the GEMMs read the codes (why: the docstring of `_kernels_tpu`)."""
        token = self._factor("dw_token") if "dw_token" in self.asked else None
        segments = self._factor("dw_channel") if "dw_channel" in self.asked else ()
        if token is None and not segments:
            return codes_dx, codes_dw
        once = codes_dx is codes_dw
        codes = (codes_dx,) if once else (codes_dx, codes_dw)
        token, segments, codes = self.layer.sum_first(token, segments, codes)
        self._factors.update({"dw_token": token, "dw_channel": segments})
        return (codes[0], codes[0]) if once else codes

    def _factor(self, name: Literal["dw_token", "dw_channel"]):
        """`Xq^T eps` (`dw_token`) or the per-segment `(Xq sums, a - m)` (`dw_channel`) of
        the dW codes' error; those of the asked terms are computed together
        (`layer.xq_sums`)."""
        if name not in self._factors:
            eps, am = self._means("dw")
            wanted = self.asked | {name}
            token, channel = "dw_token" in wanted, "dw_channel" in wanted
            t, xsum = self.layer.xq_sums(self.xq, eps if token else None, channel)
            if token:
                self._factors["dw_token"] = t
            if channel:
                self._factors["dw_channel"] = (xsum, am)
        return self._factors[name]

    @ft.cached_property
    def _gp_sums(self):
        ax, layer = self.layer.axes, self.layer
        gp = self.folded.whole
        rows = ax.psum(layer.row_sums(gp), "d_out")
        gp_segments = layer.folded_segment_sums(gp, *self.folded.inputs)
        return rows, ax.psum(gp_segments, *layer.segment_roles)

    def _means(self, which: Literal["dx", "dw"]):
        """Token means `eps` (per row) and centred channel means `a - m` (per segment) of the
        error of the dX or the dW codes, in units of `G'`."""
        q, step = self.codes[which]
        if q is self.codes["dx"][0]:
            which = "dx"  # quantized once: one set of statistics
        if which not in self._cache:
            self._cache[which] = self._statistics(q, step)
        return self._cache[which]

    def _statistics(self, q, step):
        ax, layer = self.layer.axes, self.layer
        channels = q.shape[-1] * ax.size("d_out")
        tokens = layer.segment_tokens(q)
        errors, codes = self._error_sums(q, step), self._code_sums(q, step)
        rows, segments = layer.error_sums(errors, codes, bool(self.asked & _SEGMENT_TERMS))
        eps = rows / channels
        a = segments / _column(tokens)
        m = ax.psum(layer.segment_sums(eps), *layer.segment_roles) / tokens
        return eps, a - m[:, None]

    def _error_sums(self, q, step):
        """Sums of `E = Delta Q - G'` over the channels of every row and over the rows of
        every segment (all shards), `E` formed inside the sums.

        `E` depends on `Delta`, i.e. on the global `max|G'|`: XLA cannot compute these sums
        inside the kernel that produces the upstream gradient (there they compete with
        `max|G'|` for that kernel's outputs, and XLA TPU splits it and writes an
        intermediate of the gradient's size to memory), so it computes them beside the
        quantizer, which reads `G'` anyway. The row sums are taken by rows (`by_rows`: an
        expert GEMM's on TPU chunk by chunk, `G'` formed again from the chunk of `G`,
        `_Folded`)."""
        ax, layer = self.layer.axes, self.layer
        error = lambda part, take: step * take(q).astype(_F32) - self.folded.rows(part, take)
        rows = ax.psum(layer.by_rows(lambda part, take: _sum(error(part, take), -1)), "d_out")
        e = error(layer, lambda v: v)
        return rows, ax.psum(layer.segment_sums(e), *layer.segment_roles)

    def _code_sums(self, q, step):
        """The same sums as `_error_sums`, from the sums of the codes (exact) and of `G'`."""
        ax, layer = self.layer.axes, self.layer
        gp_rows, gp_segments = self._gp_sums
        rows = step * ax.psum(layer.row_sums(q), "d_out") - gp_rows
        segments = step * ax.psum(layer.segment_sums(q), *layer.segment_roles) - gp_segments
        return rows, segments

    def _dx_factors(self):
        """`(eps, rw, v)` over all rows, for the dX terms asked for (`None` where none
        asks): the token means of the dX codes' error, the row sums `Wq 1_D` and the
        per-segment `(a - m) Wq^T`."""
        if "dx_factors" not in self._cache:
            eps = rw = v = None
            if self.asked & _DX_TERMS:
                eps, am = self._means("dx")
                if self.asked & {"dx_token", "dx_structured"}:
                    rw = self.layer.weight_row_sums(self.wq, self.codes["dx"][0])
                if self.asked & {"dx_channel", "dx_structured"}:
                    v = self.layer.channel_dx(am, self.wq)
            self._cache["dx_factors"] = (eps, rw, v)
        return self._cache["dx_factors"]

    def rows(self) -> Callable[[AbstractLayer, Callable[[Array], Array]], "_ErrorTerms"]:
        """`view(part, take)`: these terms with the dX terms of the rows of `part` only
        (see `AbstractLayer.by_rows`). The factors over all rows are computed here, so that
        an output computed in chunks of rows computes them once, outside its loop."""
        self._dx_factors()

        def view(part, take):
            terms = copy.copy(self)
            terms.part, terms.take = part, take
            return terms

        return view

    def dx_token(self):
        eps, rw, _ = self._dx_factors()
        assert eps is not None and rw is not None  # asked for (`asked_terms`)
        return self.part.token_dx(self.take(eps), rw)

    def dx_channel(self):
        v = self._dx_factors()[2]
        assert v is not None
        return self.part.segment_dx(v)

    def dx_structured(self):
        eps, rw, v = self._dx_factors()
        assert eps is not None and rw is not None and v is not None
        return self.part.structured_dx(self.take(eps), rw, v)

    def dw_token(self):
        return self._factor("dw_token")

    def dw_channel(self):
        return self.layer.channel_dw(*self._factor("dw_channel"))


class _Asked(AbstractErrorTerms):
    """Records the terms a correction asks for (see `asked_terms`); every term is zero."""

    def __init__(self):
        self.names: set[str] = set()

    def _ask(self, name: str) -> Array:
        self.names.add(name)
        return jnp.zeros((), _F32)

    def dx_token(self):
        return self._ask("dx_token")

    def dx_channel(self):
        return self._ask("dx_channel")

    def dx_structured(self):
        return self._ask("dx_structured")

    def dw_token(self):
        return self._ask("dw_token")

    def dw_channel(self):
        return self._ask("dw_channel")


def asked_terms(correction: AbstractCorrection, dx, dw) -> frozenset[str]:
    """The names of the `AbstractErrorTerms` methods `correction.correct_dx` and
    `correct_dw` call for GEMM outputs shaped as `dx` and `dw`, from an abstract trace
    (`jax.eval_shape`: nothing is computed), so that `backward` can compute the dW terms'
    factors before the GEMMs."""
    asked = _Asked()
    jax.eval_shape(lambda dx: correction.correct_dx(asked, dx), dx)
    jax.eval_shape(lambda dw: correction.correct_dw(asked, dw), dw)
    return frozenset(asked.names)


def _column(v: Array | int) -> Array | int:
    return v[:, None] if isinstance(v, jax.Array) and v.ndim == 1 else v


# --- forward and backward -------------------------------------------------------------------


class Check(typing.NamedTuple):
    """A run-time condition: `msg` is raised where `bad` is true on any shard of `roles`."""

    bad: Array
    roles: tuple
    msg: str


def passed(checks: Sequence[Check], axes: ShardAxes, dtype) -> Array:
    """A scalar `1` of `dtype`, raising at run time the message of the first check in
    `checks` that fails; multiply it into what the checks protect.

    All the checks share one `eqx.branched_error_if`: each is a conditional in the program,
    and a GPU copies the predicate of every conditional to the host. Each flag is reduced over the
    shards of its `roles` first: inside `shard_map`, `eqx.error_if` needs a value and a
    predicate that vary over the same mesh axes, and the reduced flags vary over none."""
    flags = jnp.stack([_flag(c, axes) for c in checks])
    msgs = [c.msg for c in checks]
    return eqx.branched_error_if(jnp.ones((), dtype), jnp.any(flags), jnp.argmax(flags), msgs)


def _flag(check: Check, axes: ShardAxes) -> Array:
    """`check.bad` reduced to one boolean, over the shards of its roles too."""
    bad = jnp.any(check.bad)
    return axes.pmax(bad.astype(_I32), *check.roles) > 0 if check.roles else bad


def guard(v: Array, bad: Array, axes: ShardAxes, roles: tuple, msg: str) -> Array:
    """`v`, raising `msg` at run time where the flag `bad` is true on any shard of `roles`."""
    return v * passed([Check(bad, roles, msg)], axes, v.dtype)


def _finite(v: Array, roles: tuple, msg: str) -> Check:
    return Check(~jnp.isfinite(v), roles, msg)


def _operand_shift(amax: Array, axes: ShardAxes, roles: tuple) -> Array:
    """The power of two that puts an operand's largest scale in `[2**20, 2**21)`: from the
    largest `max|.|` over all shards of `roles`, an all-zero slice counting as `QMAX` (its
    scale is 1)."""
    largest = jnp.max(jnp.where(amax == 0, float(QMAX), amax), initial=0.0)
    return normalizing_shift(axes.pmax(largest, *roles), SCALE_EXPONENT)


def _representable(s: Array, roles: tuple, msg: str) -> Check:
    """A scale (on any shard of `roles`) below the smallest normal float32: that slice is too
    small next to the operand's largest one."""
    return Check(s < jnp.finfo(_F32).tiny, roles, msg)


def _range_message(name: str, operand: str, what: str) -> str:
    return (
        f"{name}: the {what} of {operand} span more than float32 can hold in one scale vector: "
        f"one {what[:-1]} has max|{operand}| more than 2**146 times smaller than the largest "
        f"(an all-zero one counts as 127). Rescale {operand} or zero the tiny {what}."
    )


def forward(layer: AbstractLayer, x: Array, w: Array):
    """Per-row scales of `x`, per-output-channel scales of `w` (global maxima over `d_in`),
    round to nearest even, the int8 GEMM with int32 sums, rescale. Returns `y` and the
    residuals `(Xq, Wq, s_x 2**a, s_w 2**b, (a, b))`.

    The scales are kept multiplied by one power of two per operand (`2**a`, `2**b`: the
    largest scale in `[2**20, 2**21)`), and the result divided by `2**(a+b)` at the end.
    Multiplying by powers of two is exact, so this changes no bit wherever the plain scales
    and products are normal floats, and keeps them representable for tiny or huge operands.
    """
    ax = layer.axes
    rows, channels = ("batch", "seq", "d_in"), ("d_in", "d_out")
    ax_x = ax.pmax(finite_absmax(x, axis=-1, keepdims=True), "d_in")
    ax_w = ax.pmax(layer.weight_absmax(w), "d_in")
    a = _operand_shift(ax_x, ax, ("batch", "seq"))
    b = _operand_shift(ax_w, ax, ("d_out",))
    sx, sw = shifted_scale(ax_x, a), shifted_scale(ax_w, b)
    one = passed(
        (
            _finite(sx, rows, f"{layer.name}: x contains NaN or Inf."),
            _finite(sw, channels, f"{layer.name}: w contains NaN or Inf."),
            _representable(sx, rows, _range_message(layer.name, "x", "tokens")),
            _representable(sw, channels, _range_message(layer.name, "w", "output channels")),
        ),
        ax,
        _F32,
    )
    # `x` is rounded with its unchecked scales, so its codes depend on `x` alone: XLA computes
    # them once for every projection of one `x` (q/k/v, gate/up), where a checked scale per
    # call would make every call's codes a distinct value. `y` and the backward read the
    # checked scales, so the checks reach every program that uses the layer. `w` belongs to
    # one layer: it is rounded with its checked scales (rounded with the unchecked ones, the
    # TPU compile of the FFN blocks packed its temporaries with larger holes).
    xq = round_to_int8(x.astype(_F32) * pow2(a), sx)
    checked, sw = sx * one, sw * one
    wq = round_to_int8(w.astype(_F32) * pow2(b), sw)

    # The GEMM and the rescaling, by rows (the expert GEMMs on TPU: in chunks, `by_rows`).
    def y_rows(part: AbstractLayer, take: Callable[[Array], Array]) -> Array:
        acc = ax.psum(part.gemm(take(xq), wq), "d_in")  # exact int32 sums
        y = unshift(acc.astype(_F32) * take(checked) * part.row_scales(sw), a + b)
        return y.astype(x.dtype)

    return layer.by_rows(y_rows), (xq, wq, checked, sw, (a, b))


MIN_STEP = 2.0**-118
"""The smallest per-tensor gradient step `backward` accepts: float32 flushes values of `G'`
below `2**-126`, less than `2**-8` of a step, which round to code 0 under round-to-nearest
and under 7-bit thresholds whether or not they are flushed."""


_G_ROLES = ("batch", "seq", "d_out")


def gradient_max(gp: Array, axes: ShardAxes) -> Array:
    """`max|G'|` over the whole logical tensor (`+inf` if `G'` holds a NaN or an Inf)."""
    return axes.pmax(finite_absmax(gp), *_G_ROLES)


def gradient_checks(amax: Array, name: str) -> tuple[Check, Check]:
    """The checks of the upstream gradient, from `max|G'|`: not finite, or so small that its
    step is below float32's range."""
    return (
        Check(
            ~jnp.isfinite(amax),
            (),
            f"{name}: the upstream gradient contains NaN or Inf (check the loss and the layers "
            "above this one).",
        ),
        Check(
            (amax > 0) & (amax < QMAX * MIN_STEP),
            (),
            f"{name}: the gradient step max|s_x G s_w| / 127 is below float32's range: the "
            "upstream gradient is nonzero only on tokens or channels whose scales are more "
            "than 2**150 times smaller than the largest ones. Rescale x or w.",
        ),
    )


def quantize(
    policy: AbstractPolicy,
    gp: Array,
    amax: Array,
    key: PRNGKeyArray | None,
    layout: Layout,
):
    """The codes and step of `G'` for the dX and the dW GEMM, `((Q_dx, Delta), (Q_dw,
    Delta))`: one pair (the same objects) for topologies that quantize once, else two, rounded
    with independent keys."""
    topology, fmt = policy.topology, policy.fmt
    if topology.quantizes_once():
        codes = fmt.quantize(gp, amax, topology.thresholds(key, layout, "dx"))
        return codes, codes
    assert key is not None
    kx, kw = jr.split(key)
    return (
        fmt.quantize(gp, amax, topology.thresholds(kx, layout, "dx")),
        fmt.quantize(gp, amax, topology.thresholds(kw, layout, "dw")),
    )


def _codes(policy: AbstractPolicy, layer: AbstractLayer, folded: _Folded, amax, key):
    """`quantize` of `G'`, by rows (`AbstractLayer.over_rows`): a format rounds every row
    with its own thresholds, `max|G'|` and the step alone shared by all rows, so codes
    computed chunk by chunk are the codes of all rows at once."""
    once = policy.topology.quantizes_once()

    def codes_rows(part: AbstractLayer, take: Callable[[Array], Array]):
        gp = folded.rows(part, take)
        codes = quantize(policy, gp, amax, key, layout=part.layout(gp))
        return codes[:1] if once else codes

    # Every chunk's step is the same value, a function of `max|G'|`.
    rows_and_step = lambda chunks: tuple((_rows_of_chunks(q), step[0]) for q, step in chunks)
    codes = layer.over_rows(codes_rows, rows_and_step)
    return (codes[0], codes[0]) if once else tuple(codes)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0,))
def first_order_only(name: str, arrays):
    """The identity on `arrays`, whose derivative raises (at trace time).

    The backward pass passes its float inputs (the upstream gradient and the scales) through
    it. First-order autodiff only calls a backward pass; differentiating through one
    (`jax.grad` of `jax.grad`, `jax.jvp` of `jax.grad`, `jax.hessian`) differentiates its
    rounding, whose derivative is zero almost everywhere, and would return finite, wrong
    numbers: this raises instead."""
    return arrays


@first_order_only.defjvp
def _first_order_only_jvp(name, primals, tangents):
    raise NotImplementedError(
        f"{name}: higher-order derivatives (jax.grad of jax.grad, jax.jvp of jax.grad, "
        "jax.hessian) are not defined: the backward pass rounds the gradient to a low-precision "
        "grid, whose derivative is zero almost everywhere, so they would be wrong. Take "
        "second-order quantities of the float model (policy=None)."
    )


def backward(
    policy: AbstractPolicy,
    layer: AbstractLayer,
    residuals,
    key,
    g,
    dx_dtype,
    dw_wanted: bool = True,
):
    """dX (in `dx_dtype`, x's dtype; `None` where `dx_dtype` is `None`) and dW (float32;
    `None` unless `dw_wanted`) of the quantized matmul for the upstream gradient `g`, the
    checks of that gradient (`gradient_checks`), for the caller to attach to both, and
    whether dW has error-correction terms (for `AbstractLayer.together`). A gradient not
    wanted gets no error terms either. dX is cast by rows, so an expert GEMM's dX computed
    in chunks of rows is written in x's dtype, not in float32."""
    xq, wq, sx, sw, (a, b) = residuals
    g, sx, sw = first_order_only(layer.name, (g, sx, sw))
    ax = layer.axes
    # G times a power of two `2**c` too (its largest |value| in [1, 2)): every product below
    # is then a normal float, G' is the plain one times 2**(a+b+c) exactly.
    c = normalizing_shift(ax.pmax(jnp.max(jnp.abs(g), initial=0).astype(_F32), *_G_ROLES))
    # Fold both scales into the gradient (float32 even for bf16 G), one per-tensor step.
    folded = _Folded(layer, g, pow2(c), sx, sw)
    # The gradient's checks guard dX and dW, not the codes: the quantizer and the GEMMs do
    # not wait for them (a NaN or a too small step only makes meaningless codes).
    amax = ax.pmax(folded.absmax(), *_G_ROLES)
    codes_dx, codes_dw = _codes(policy, layer, folded, amax, key)
    shapes = (
        jax.eval_shape(layer.gemm_dx, codes_dx[0], wq),
        jax.eval_shape(layer.gemm_dw, xq, codes_dw[0]),
    )
    asked = asked_terms(policy.correction, *shapes)
    asked -= (_DX_TERMS if dx_dtype is None else frozenset()) | (
        frozenset() if dw_wanted else _DW_TERMS
    )
    terms = _ErrorTerms(layer, folded, codes_dx, codes_dw, xq, wq, asked)
    codes_dx, codes_dw = terms.sum_factors_first(codes_dx, codes_dw)
    # The two GEMMs, one set of codes feeding both unless the topology quantizes twice, and
    # S3R-EC: the correction subtracts parts of the structured error's image. The GEMM
    # outputs and the terms are this shard's partial sums (dX over its `d_out` block, dW over
    # its rows); the terms are linear in them, so each shard corrects its own part and one
    # shard sum adds the corrected parts. dX may be computed in chunks of rows (`by_rows`).
    # dX is divided by `s_x` and cast to x's dtype by rows. (As a product with `1 / s_x`, a
    # value of the forward's scales alone, the TPU compile of Table IV's 32-layer
    # Llama 3.1-8B step needed 7 GiB more. Inside a loop of chunks XLA:CPU computes the
    # division as that product: a chunked dX may differ from a whole one by a rounding.)
    q_dx, view = codes_dx[0], terms.rows()

    def dx_rows(part: AbstractLayer, take: Callable[[Array], Array]) -> Array:
        dx = codes_dx[1] * part.gemm_dx(take(q_dx), wq)
        dx = ax.psum(policy.correction.correct_dx(view(part, take), dx), "d_out")
        return unshift(dx / take(sx), b + c).astype(dx_dtype)

    dx = dw = None
    if dx_dtype is not None:
        dx = layer.by_rows(dx_rows)
    if dw_wanted:
        dw = codes_dw[1] * layer.gemm_dw(xq, codes_dw[0])
        dw = ax.psum(policy.correction.correct_dw(terms, dw), "batch", "seq")
        dw = unshift(layer.weight_gradient(dw, sw), a + c)
    return dx, dw, gradient_checks(amax, layer.name), bool(asked & _DW_TERMS)


def _overflow(layer: AbstractLayer, which: str) -> str:
    return (
        f"{layer.name}: {which} is not finite (beyond the range of its dtype): either the "
        "true gradient exceeds that range, or the tokens of x (the output channels of w) span "
        "so wide a range that the error correction, which spreads the rounding error of the "
        "large ones over all of them, overflows on the small ones. Rescale x or w, or bound "
        "the outliers."
    )


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def quantized_matmul(policy: AbstractPolicy, layer: AbstractLayer, x, w, key):
    """`forward(layer, x, w)` with the quantized backward as its VJP."""
    return forward(layer, x, w)[0]


def _fwd(policy, layer, x, w, key):
    # With `symbolic_zeros=True` every leaf of the differentiated arguments comes as a
    # `CustomVJPPrimal`: its value, and whether it is differentiated (`perturbed`). A
    # gradient nobody asks for (frozen weights) is not computed: XLA would drop an unused one
    # by itself, but not one tied to the other (`AbstractLayer.together`).
    layer, key = jax.tree.map(lambda p: p.value, (layer, key), is_leaf=_is_primal)
    y, residuals = forward(layer, x.value, w.value)
    # Dtypes travel as zero-size arrays (numpy dtype objects cannot be residuals); `None`
    # where the input is not differentiated.
    like = lambda p: jnp.zeros((0,), p.value.dtype) if p.perturbed else None
    return y, (layer, residuals, key, like(x), like(w))


def _is_primal(v) -> bool:
    return isinstance(v, CustomVJPPrimal)


def _bwd(policy, saved, g):
    layer, residuals, key, x_like, w_like = saved
    if isinstance(g, SymbolicZero):  # `y` does not reach the loss
        return None, None, None, None
    dx, dw, checks, dw_terms = backward(
        policy,
        layer,
        residuals,
        key,
        g,
        None if x_like is None else x_like.dtype,
        w_like is not None,
    )
    # Each gradient carries one check: the upstream gradient's, then its own finiteness (the
    # inputs were checked, so a non-finite one overflowed here).
    ax = layer.axes
    if dx is not None:
        dx = dx * passed(
            (*checks, _finite(dx, ("batch", "seq", "d_in"), _overflow(layer, "dX"))),
            ax,
            dx.dtype,
        )
    if dw is not None:
        dw = dw.astype(w_like.dtype)
        dw = dw * passed(
            (*checks, _finite(dw, ("d_in", "d_out"), _overflow(layer, "dW"))), ax, dw.dtype
        )
    if dw_terms and dx is not None:  # after the checks, whose flags are small buffers too
        dx, dw = layer.together(dx, dw)
    return None, dx, dw, None


quantized_matmul.defvjp(_fwd, _bwd, symbolic_zeros=True)
