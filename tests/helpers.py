"""Shared lists and tools for the test suite (one suite over every policy, as optax does)."""

import gc
import itertools
import math
import re

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr

import s3req._backward as backward
from policies import (
    DxOnlyEC,
    Independent,
    Nearest,
    NoEC,
    Phi2D,
    PhiBcast,
    Policy,
    TwoWayEC,
)


def with_kernels(kernels: str, fn):
    """`fn` traced with `s3req._backward.KERNELS = kernels` (read at trace time): the
    reference path, or one backend's kernels on this CPU."""

    def wrapped(*args):
        old = backward.KERNELS
        backward.KERNELS = kernels
        try:
            return fn(*args)
        finally:
            backward.KERNELS = old

    return wrapped


def ragged_vjp(policy, x, w, gs, g, key, row_id, example_id, axes=None, *, num_examples):
    """`(y, dX, dW)` of `qragged_dot` for the upstream gradient `g`."""
    from s3req import qragged_dot

    def f(x, w):
        return qragged_dot(
            x,
            w,
            gs,
            policy=policy,
            key=key,
            row_id=row_id,
            example_id=example_id,
            num_examples=num_examples,
            axes=axes,
        )

    y, pull = jax.vjp(f, x, w)
    return (y, *pull(g))


ALL_TOPOLOGIES = [
    Nearest(),
    Independent(),
    Independent(shared=True),
    Phi2D(),
    PhiBcast(),
]
STOCHASTIC_TOPOLOGIES = [t for t in ALL_TOPOLOGIES if t.stochastic]
ALL_CORRECTIONS = [NoEC(), DxOnlyEC(), TwoWayEC()]

# Every valid topology x correction pair (round-to-nearest takes no correction).
ALL_POLICIES = [Policy(Nearest())] + [
    Policy(t, c) for t, c in itertools.product(STOCHASTIC_TOPOLOGIES, ALL_CORRECTIONS)
]
STOCHASTIC_POLICIES = [p for p in ALL_POLICIES if p.stochastic]


def policy_id(p) -> str:
    if p is None:
        return "float"
    t = type(p.topology).__name__
    if getattr(p.topology, "shared", False):
        t += "(shared)"
    return f"{t}-{type(p.correction).__name__}"


def iter_eqns(jaxpr: Jaxpr):
    """Every equation of a jaxpr and of all its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, ClosedJaxpr):
                    yield from iter_eqns(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    yield from iter_eqns(sub)


def dot_eqns(fn, *args):
    """All `dot_general` equations in the jaxpr of `fn(*args)` (args may be ShapeDtypeStructs)."""
    closed = jax.make_jaxpr(fn)(*args)
    return [e for e in iter_eqns(closed.jaxpr) if e.primitive.name == "dot_general"]


def exact_problem(key, B=2, S=8, H=16, D=32):
    """X, W, G exactly on their int8 grids with power-of-two scales.

    Every row of X has max |code| 127, every column of W too, and G is chosen so that
    G' = s_x G s_w is an integer multiple of the per-tensor step with max |code| 127: all
    rounding is exact, so every policy must return the float gradient.
    """
    k1, k2, k3 = jax.random.split(key, 3)

    def codes(k, shape, axis):
        c = jax.random.randint(k, shape, -127, 128).astype(jnp.float32)
        # force max |code| = 127 along `axis`
        idx = jnp.argmax(jnp.abs(c), axis=axis, keepdims=True)
        return jnp.where(
            jnp.arange(c.shape[axis]).reshape(
                [-1 if i == axis % c.ndim else 1 for i in range(c.ndim)]
            )
            == idx,
            127.0,
            c,
        )

    ex = jax.random.randint(k1, (B, S, 1), -3, 3).astype(jnp.float32)
    sx = 2.0**ex
    ew = jax.random.randint(k2, (1, D), -3, 3).astype(jnp.float32)
    sw = 2.0**ew
    X = codes(k1, (B, S, H), -1) * sx
    W = codes(k2, (H, D), 0) * sw
    Gc = codes(k3, (B, S, D), -1)
    G = Gc * 2.0**-4 / (sx * sw[None])
    return X, W, G


def release_executables() -> None:
    """Free every compiled program of this process.

    XLA CPU keeps each JIT-compiled code section in its own memory mapping for as long as its
    executable lives, and the compile caches keep them all alive. The slow sharded-training
    tests (16 runs in one process) reached the kernel's limit of 65530 mappings
    (`vm.max_map_count`) and LLVM aborted ("Unable to allocate section memory")."""
    jax.clear_caches()
    gc.collect()


def quantizations(compiled, size: int) -> set[str]:
    """The distinct operand lists of the fusions of a compiled program's optimized HLO that
    write an int8 array of `size` elements: one per distinct rounding of an operand of that size
    (its codes and a transposed copy of them read the same operands)."""
    text = compiled.as_text()
    assert text is not None
    found = set()
    for line in text.splitlines():
        m = re.search(r"= s8\[([\d,]*)\]\S* fusion\(([^)]*)\)", line)
        if m and math.prod(int(d) for d in m.group(1).split(",") if d) == size:
            found.add(m.group(2))
    return found
