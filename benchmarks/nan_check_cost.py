"""Cost of the NaN/Inf checks of `qdot` (docs/guides/reliability.md).

Times one `qdot` forward+backward with the input check (`finite_absmax`: `max|.|` plus an
`isnan` reduction per tensor) and without it (the same program with a plain `max|.|`), then
with the output check (`dX` and `dW` finite after the cast, `_bwd`) and without it (the
upstream gradient's checks stay), each pair compiled first and then timed round-robin in one
process; prints the medians and their ratio.

    python benchmarks/nan_check_cost.py [--shape 4x256x1024x4096] [--repeats 15]
"""

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import s3req._backward as _backward
import s3req._quantize as _quantize
from policies import preset
from s3req import qdot, ShardAxes


def _plain_absmax(x, axis=None, keepdims=False):
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=keepdims)


def _program(policy, args):
    def f(x, w, g, key):
        y, pull = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
        return y, pull(g)

    return jax.jit(f).lower(*args).compile()


def compare(description: str, labels: tuple[str, str], patched) -> None:
    """Time the `qdot` forward+backward as the engine runs it (`labels[0]`) against the same
    program compiled inside the context manager `patched()` (`labels[1]`), round-robin in one
    process, for every policy of the command line; print the medians and their ratio."""
    parser = argparse.ArgumentParser(description=description)
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
    print(description)
    print(f"qdot fwd+bwd x({B},{S},{H}) bf16 @ w({H},{D}) f32, {jax.devices()[0].platform}")
    for name in args.policies.split(","):
        policy = preset(name)
        programs = {labels[0]: _program(policy, operands)}
        with patched():
            programs[labels[1]] = _program(policy, operands)
        if programs[labels[0]].as_text() == programs[labels[1]].as_text():
            raise RuntimeError(f"{labels[1]}: the same program as {labels[0]}; the patch missed")
        times = {label: [] for label in labels}
        for _ in range(args.repeats):
            for label, prog in programs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(prog(*operands))
                times[label].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in times.items()}
        a, b = labels
        print(
            f"{name:>12}: {a} {1e3 * med[a]:.1f} ms, {b} {1e3 * med[b]:.1f} ms, "
            f"ratio {med[a] / med[b]:.3f}"
        )


@contextlib.contextmanager
def _unchecked():
    # Every module that calls the check holds its own reference to it.
    saved = (_quantize.finite_absmax, _backward.finite_absmax)
    _quantize.finite_absmax = _backward.finite_absmax = _plain_absmax
    try:
        yield
    finally:
        _quantize.finite_absmax, _backward.finite_absmax = saved


@contextlib.contextmanager
def _outputs_unchecked():
    # `_finite` also checks the scales; only the checks with the overflow message are dropped.
    saved = _backward._finite
    marker = _backward._overflow(_backward.Dense(ShardAxes(), False), "dX").split("dX", 1)[1]

    def finite(v, roles, msg):
        return (
            _backward.Check(jnp.zeros((), bool), (), msg)
            if marker in msg
            else saved(v, roles, msg)
        )

    _backward._finite = finite
    try:
        yield
    finally:
        _backward._finite = saved


def main():
    compare("Cost of the NaN/Inf check of qdot's inputs.", ("checked", "unchecked"), _unchecked)
    compare(
        "Cost of the finiteness check of qdot's outputs.",
        ("output checked", "output unchecked"),
        _outputs_unchecked,
    )


if __name__ == "__main__":
    main()
