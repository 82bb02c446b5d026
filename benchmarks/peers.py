"""The same quantized linear layer in s3req, AQT and Qwix, measured side by side in one process.

One layer, `x (batch, seq, d_in) @ w (d_in, d_out)`, fully quantized (int8 forward, int8
backward), in

- **s3req**: `qdot` with the policies `rtne`, `sr`, `s3r`, `s3r-ec-dx`, `s3r-ec-2way`
  (`policies.preset`);
- **AQT** (`aqtp`, `aqt.jax.v2`): `config.fully_quantized` with round to nearest (`aqt-rtne`)
  and with stochastic rounding of the gradient (`vjp_lhs_stochastic_rounding=True`, one
  `jax.random.uniform` value per element: `aqt-sr`);
- **Qwix**: its QT path (`dot_general_qt`, the configuration `QtProvider` builds for an int8
  `QtRule` with `bwd_qtype=int8`) with round to nearest (`qwix-rtne`, `QtRule`'s default),
  with `bwd_stochastic_rounding="uniform"` and its default `channelwise_noise_axes=(0,)`, one
  noise value per example broadcast over its tokens and channels (`qwix-sr`), and with noise on
  every axis (`qwix-sr-elem`, per element).

Measured for every method:

- **time** of one forward + backward (`jax.vjp`, the forward output returned so XLA keeps the
  forward GEMM), compiled first, then timed round-robin (interleaved repeats: every method sees
  the same machine load); median and interquartile range, reported as ratios to s3req RTNE;
- **temporaries**: XLA's compile-time estimate (`memory_analysis().temp_size_in_bytes`);
- **forward agreement**: relative Frobenius error of the output against the float `x @ w`, and
  its relative difference from s3req's forward;
- **gradient error**: relative Frobenius error of dX and dW against the float gradient, mean
  over keys (+- standard error);
- **bias over keys**, against the exact gradient of the forward each method executes (int8
  with per-token / per-channel absmax scales in all three; `dX = G Wq^T`, `dW = Xq^T G` with
  its dequantized operands, recovered by `executed_operands`; the forward's relative
  difference from `Xq Wq` is recorded as a check): `||mean error|| / ||exact||` over all keys,
  the value an unbiased estimator shows from noise alone (`sqrt(tr Cov / K) / ||exact||`), and
  a z-score of the squared bias: the keys are split into groups, each group gives an unbiased
  estimate of `||bias||^2` (its squared mean error minus its summed sample variance over its
  size), and z is their mean over its standard error. |z| < 5 means no bias is detectable.

Two weights: `iid` (Gaussian) and `shared` (every row of `w` is the same vector `c`, of
mean 1, plus Gaussian noise: a weight whose rows share a component, where a gradient error
shared across an example's tokens and channels adds up coherently in dX). The upstream
gradient is heavy-tailed (Gaussian times a log-normal), as in `benchmarks/bench_qdot.py`.

    python benchmarks/peers.py                          # writes docs/results/peers.{json,md}
    python benchmarks/peers.py --time-shape 2x64x256x512 --stats-shape 2x16x64x128 \\
        --keys 64 --repeats 3 --out /tmp/peers          # smoke test

Needs the `peers` extra (`pip install s3req[peers]`: `aqtp`, `qwix`).
"""

import argparse
import dataclasses
import json
import pathlib
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from policies import preset
from s3req import qdot


ROOT = pathlib.Path(__file__).resolve().parent.parent
DIMS = (((2,), (0,)), ((), ()))  # x (b, s, d_in) . w (d_in, d_out)
S3REQ = ("rtne", "sr", "s3r", "s3r-ec-dx", "s3r-ec-2way")
PEERS = ("aqt-rtne", "aqt-sr", "qwix-rtne", "qwix-sr", "qwix-sr-elem")
METHODS = S3REQ + PEERS
LABELS = {
    "rtne": "s3req INT8 RTNE",
    "sr": "s3req Independent SR",
    "s3r": "s3req S3R",
    "s3r-ec-dx": "s3req S3R-EC dX-only",
    "s3r-ec-2way": "s3req S3R-EC two-way",
    "aqt-rtne": "AQT int8, RTNE",
    "aqt-sr": "AQT int8, SR of the gradient (per element)",
    "qwix-rtne": "Qwix QT int8, RTNE",
    "qwix-sr": "Qwix QT int8, SR, default noise (one per example)",
    "qwix-sr-elem": "Qwix QT int8, SR, noise per element",
}


def _s3req_layer(name: str):
    policy = preset(name)

    def layer(x, w, key):
        return qdot(x, w, policy=policy, key=key)

    return layer


def _aqt_layer(stochastic: bool):
    from aqt.jax.v2 import config

    if stochastic:
        cfg = config.fully_quantized(
            fwd_bits=8,
            bwd_bits=8,
            use_stochastic_rounding=None,
            vjp_lhs_stochastic_rounding=True,
            vjp_rhs_stochastic_rounding=False,
        )
    else:
        cfg = config.fully_quantized(fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False)

    def layer(x, w, key):
        return config.set_context(cfg, key=key, train_step=None)(x, w, DIMS)

    return layer


def _qwix_layer(noise_axes: tuple[int, ...] | None):
    from qwix._src.core import dot_general_qt, stochastic_rounding

    # the configuration QtProvider builds for QtRule(weight_qtype=act_qtype=bwd_qtype=int8)
    base = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=jnp.int8,
        rhs_qtype=jnp.int8,
        dlhs_grad_qtype=jnp.int8,
        drhs_grad_qtype=jnp.int8,
    )

    def layer(x, w, key):
        cfg = base
        if noise_axes is not None:  # QtProvider passes one noise function to both GEMMs
            noise = stochastic_rounding.get_noise_fn("uniform", key, noise_axes)
            cfg = dataclasses.replace(
                base,
                dlhs_stochastic_rounding_noise_fn=noise,
                drhs_stochastic_rounding_noise_fn=noise,
            )
        return dot_general_qt.dot_general_qt(x, w, DIMS, cfg)

    return layer


def layers() -> dict:
    """`name -> f(x, w, key) -> y` for every method of `METHODS`."""
    out: dict[str, Callable] = {n: _s3req_layer(n) for n in S3REQ}
    out["aqt-rtne"] = _aqt_layer(False)
    out["aqt-sr"] = _aqt_layer(True)
    out["qwix-rtne"] = _qwix_layer(None)
    out["qwix-sr"] = _qwix_layer((0,))
    out["qwix-sr-elem"] = _qwix_layer((0, 1, 2))
    return out


def fwd_bwd(layer):
    """`(x, w, g, key) -> (y, (dx, dw))`: the forward output and the vjp of `g`."""

    def f(x, w, g, key):
        y, vjp = jax.vjp(lambda x, w: layer(x, w, key), x, w)
        return y, vjp(g)

    return f


def make_inputs(B: int, S: int, H: int, D: int, weight: str, seed: int = 0):
    """`x, w, g`: Gaussian activations, a weight (`"iid"` or `"shared"`: rows = common
    vector + noise) and a heavy-tailed upstream gradient, all float32."""
    k = jr.split(jr.key(seed), 5)
    x = jr.normal(k[0], (B, S, H))
    w = jr.normal(k[1], (H, D))
    if weight == "shared":  # every row the same vector c, of mean 1, plus noise
        w = w + 1.0 + jr.normal(k[4], (1, D))
    elif weight != "iid":
        raise ValueError(f"weight must be 'iid' or 'shared', got {weight!r}")
    w = w / np.sqrt(H)
    g = jr.normal(k[2], (B, S, D)) * jnp.exp(jr.normal(k[3], (B, S, D)))
    return x, w, g


def executed_operands(layer, x, w):
    """The dequantized operands `xh, wh` of the forward that `layer` executes on `x, w`.

    Every method here quantizes `x` per token and `w` per output channel with symmetric absmax
    scales, so its forward is `xh @ wh`: `layer(x, I)` is `c * xh` and `layer(I, w)` is
    `c * wh`, where `c` is what one side's quantization makes of a one-hot vector (1 for
    s3req; 127/127.5 for a library that maps absmax to 127.5 and clips to 127), the same for
    both sides, so `layer(I, I) = c**2 I`."""
    H = x.shape[-1]
    eye = jnp.eye(H, dtype=x.dtype)
    key = jr.key(0)
    c = jnp.sqrt(layer(eye[None], eye, key)[0, 0, 0])
    return layer(x, eye, key) / c, layer(eye[None], w, key)[0] / c


def _stats(samples: list[np.ndarray]) -> dict:
    a = np.asarray(samples)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median_s": float(med), "q1_s": float(q1), "q3_s": float(q3)}


def measure_speed(shape: tuple[int, int, int, int], repeats: int) -> dict:
    """Time and temporaries of every method at `shape = (B, S, d_in, d_out)`."""
    x, w, g = make_inputs(*shape, "iid")
    key = jr.key(1)
    progs = {n: fwd_bwd(f) for n, f in layers().items()}
    jitted = {n: jax.jit(f) for n, f in progs.items()}
    temp = {}
    for n, f in progs.items():
        stats = jax.jit(f).lower(x, w, g, key).compile().memory_analysis()
        temp[n] = int(stats.temp_size_in_bytes) if stats is not None else -1
    for f in jitted.values():  # compile + warm up
        jax.block_until_ready(f(x, w, g, key))
        jax.block_until_ready(f(x, w, g, key))
    times = {n: [] for n in jitted}
    ratios = {n: [] for n in jitted}
    for _ in range(repeats):  # round-robin: every method sees the same machine load
        for n, f in jitted.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w, g, key))
            times[n].append(time.perf_counter() - t0)
        for n in jitted:  # per-round ratio to s3req RTNE of the same round
            ratios[n].append(times[n][-1] / times["rtne"][-1])
    return {
        "shape": list(shape),
        "repeats": repeats,
        "time": {n: _stats(t) for n, t in times.items()},
        "ratio_to_rtne": {n: _stats(r) for n, r in ratios.items()},
        "temp_bytes": temp,
    }


def _rel(a, b) -> jax.Array:
    return jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel())


def _bias(errors: np.ndarray, ref: np.ndarray, groups: int) -> dict:
    """Bias statistics of `errors` (keys, ...) against the exact gradient `ref`."""
    K = errors.shape[0]
    e = errors.reshape(K, -1).astype(np.float64)
    nref = float(np.linalg.norm(ref))
    m = e.mean(0)
    floor = np.sqrt(e.var(0, ddof=1).sum() / K)
    per = e.reshape(groups, K // groups, -1)
    n = per.shape[1]
    b2 = (per.mean(1) ** 2).sum(-1) - per.var(1, ddof=1).sum(-1) / n  # unbiased ||bias||^2
    se = b2.std(ddof=1) / np.sqrt(groups)
    return {
        "mean_error_rel": float(np.linalg.norm(m) / nref),
        "noise_floor_rel": float(floor / nref),
        "bias2_z": float(b2.mean() / se) if se > 0 else 0.0,
    }


def measure_quality(
    shape: tuple[int, int, int, int], weight: str, n_keys: int, groups: int = 16
) -> dict:
    """Forward agreement, gradient error and bias over `n_keys` keys of every method."""
    if n_keys % groups or n_keys // groups < 2:
        raise ValueError(f"n_keys={n_keys} must be a multiple of groups={groups}, >= 2 each")
    x, w, g = make_inputs(*shape, weight)
    y_float = x @ w
    dx_float, dw_float = g @ w.T, jnp.einsum("bsh,bsd->hd", x, g)
    y_ours = qdot(x, w, policy=preset("rtne"))
    keys = jr.split(jr.key(2), n_keys)
    rows = {}
    for name, layer in layers().items():
        f = fwd_bwd(layer)
        # the operands are arguments, not constants XLA would fold at compile time
        run = jax.jit(jax.vmap(lambda k, x, w, g, f=f: f(x, w, g, k)[1], (0, None, None, None)))
        y = jax.jit(lambda x, w, layer=layer: layer(x, w, jr.key(0)))(x, w)
        xh, wh = executed_operands(layer, x, w)
        dx_exec, dw_exec = g @ wh.T, jnp.einsum("bsh,bsd->hd", xh, g)
        dxs, dws = [], []
        for chunk in np.split(np.arange(n_keys), groups):
            dx, dw = run(keys[chunk], x, w, g)
            dxs.append(np.asarray(dx))
            dws.append(np.asarray(dw))
        dx, dw = np.concatenate(dxs), np.concatenate(dws)
        err = {}
        for which, est, ref_float, ref_exec in (
            ("dx", dx, dx_float, dx_exec),
            ("dw", dw, dw_float, dw_exec),
        ):
            nf = np.linalg.norm(np.asarray(ref_float))
            rel = np.linalg.norm((est - np.asarray(ref_float)[None]).reshape(n_keys, -1), axis=1)
            rel = rel / nf
            err[which] = {
                "error_vs_float": float(rel.mean()),
                "error_vs_float_se": float(rel.std(ddof=1) / np.sqrt(n_keys)),
                "bias_vs_executed": _bias(
                    est - np.asarray(ref_exec)[None], np.asarray(ref_exec), groups
                ),
            }
        rows[name] = {
            "forward_error_vs_float": float(_rel(y, y_float)),
            "forward_diff_vs_s3req": float(_rel(y, y_ours)),
            "forward_vs_executed_operands": float(_rel(y, xh @ wh)),
            **err,
        }
    return {"shape": list(shape), "weight": weight, "keys": n_keys, "groups": groups, "rows": rows}


def _shape(spec: str) -> tuple[int, int, int, int]:
    parts = tuple(int(v) for v in spec.split("x"))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape must be BxSxHxD, got {spec!r}")
    return parts  # type: ignore[return-value]


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("jax", "jaxlib", "aqtp", "qwix")}


def markdown(s: dict) -> str:
    """The results page of one run `s` (as written to `peers.json`)."""
    sp = s["speed"]
    B, S, H, D = sp["shape"]
    v = s["meta"]["versions"]
    out = [
        "# The peers side by side: s3req, AQT and Qwix",
        "",
        f"Written by `{s['meta']['command']}` on {s['meta']['machine']} "
        f"(jax {v['jax']}, aqtp {v['aqtp']}, qwix {v['qwix']}). One fully quantized linear "
        "layer `x (batch, seq, d_in) @ w (d_in, d_out)` in every library, in one process; "
        "what each row is and how each number is computed: the docstring of "
        "`benchmarks/peers.py`.",
        "",
        f"## Time and temporaries: x {B}x{S}x{H} @ w {H}x{D}, float32",
        "",
        f"Forward + backward, {sp['repeats']} interleaved repeats; median (interquartile "
        "range) of the per-round ratio to s3req INT8 RTNE. CPU times on a shared machine are "
        "noisy: only the ratios mean something. Temporaries: XLA's compile-time estimate.",
        "",
        "| method | time / s3req RTNE | temporaries (MiB) |",
        "| --- | ---: | ---: |",
    ]
    for n in METHODS:
        r = sp["ratio_to_rtne"][n]
        out.append(
            f"| {LABELS[n]} | {r['median_s']:.2f} ({r['q1_s']:.2f}-{r['q3_s']:.2f}) "
            f"| {sp['temp_bytes'][n] / 2**20:.1f} |"
        )
    t = {n: sp["ratio_to_rtne"][n]["median_s"] for n in METHODS}
    out += [
        "",
        f"AQT RTNE / s3req RTNE: {t['aqt-rtne']:.2f}; AQT SR / s3req S3R: "
        f"{t['aqt-sr'] / t['s3r']:.2f}; Qwix SR (default) / s3req S3R: "
        f"{t['qwix-sr'] / t['s3r']:.2f}; Qwix SR per element / s3req S3R: "
        f"{t['qwix-sr-elem'] / t['s3r']:.2f}.",
    ]
    for q in s["quality"]:
        B, S, H, D = q["shape"]
        out += [
            "",
            f"## Accuracy, `{q['weight']}` weight: x {B}x{S}x{H} @ w {H}x{D}, {q['keys']} keys",
            "",
            "Forward: relative error against float `x @ w`, and relative difference from "
            "s3req's forward. dX / dW error: relative Frobenius error against the float "
            "gradient, mean over keys (+- standard error). Bias: `||mean error|| / ||exact||` "
            "against the exact gradient of the executed int8 forward, beside the noise floor "
            "(what an unbiased estimator shows from noise alone), and z of the squared bias "
            f"({q['groups']} groups of keys; |z| < 5: no bias detectable).",
            "",
            "| method | fwd err | fwd vs s3req | dX err | dW err | dX bias / floor (z) "
            "| dW bias / floor (z) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n in METHODS:
            r = q["rows"][n]
            cells = []
            for which in ("dx", "dw"):
                e = r[which]
                cells.append(f"{e['error_vs_float']:.4f} +- {e['error_vs_float_se']:.4f}")
            for which in ("dx", "dw"):
                b = r[which]["bias_vs_executed"]
                cells.append(
                    f"{b['mean_error_rel']:.4f} / {b['noise_floor_rel']:.4f} ({b['bias2_z']:+.1f})"
                )
            out.append(
                f"| {LABELS[n]} | {r['forward_error_vs_float']:.4f} "
                f"| {r['forward_diff_vs_s3req']:.4f} | " + " | ".join(cells) + " |"
            )
    out += [
        "",
        "## Reading the tables",
        "",
        "- RTNE rows are deterministic: their bias is their whole error (floor 0, z not "
        "meaningful beyond 'biased'). The peers scale the gradient per token (dX) and per "
        "channel (dW); s3req uses one per-tensor step, so a peer's RTNE gradient can be more "
        "accurate than s3req's.",
        "- Qwix's default noise (`channelwise_noise_axes=(0,)`) is one uniform value per "
        "example: the rounding errors of an example's tokens and channels are correlated, "
        "and a weight whose rows share a component sums them coherently in dX. s3req's S3R "
        "without error correction correlates its rounding errors too (shared threshold "
        "structure) and shows the same effect on that weight; its error corrections remove it.",
        "- A z above 5 for a stochastic row is a bias against that method's own executed "
        "forward that more keys do not average away. This script measures it; it does not "
        "isolate its cause (candidates: AQT quantizes the saved operands again in its "
        "backward; the peers map absmax to 127.5 and clip to 127, so a row's largest "
        "element cannot round up).",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--time-shape", type=_shape, default=(4, 256, 512, 2048))
    ap.add_argument("--stats-shape", type=_shape, default=(4, 64, 256, 512))
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    command = "python benchmarks/peers.py" + (" " + " ".join(argv) if argv else "")
    if argv is None:
        import sys

        command = "python benchmarks/peers.py" + "".join(" " + a for a in sys.argv[1:])
    s = {
        "meta": {
            "command": command,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
            + f", {jax.devices()[0].platform}, {jax.local_device_count()} device(s)",
            "versions": _versions(),
        },
        "speed": measure_speed(args.time_shape, args.repeats),
        "quality": [measure_quality(args.stats_shape, wt, args.keys) for wt in ("iid", "shared")],
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(s, indent=1) + "\n")
    (out / "peers.md").write_text(markdown(s))
    return s


if __name__ == "__main__":
    main()
