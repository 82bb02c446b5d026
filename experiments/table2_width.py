"""Table II across widths: does the dX penalty of S3R (Phi2D) grow with the width, as
Proposition 1 predicts, and does S3R-EC remove it?

For each width D in {128, 256, 512, 1024, 2048} a 2-layer Llama (head width 32, n_kv_heads =
n_heads / 2, SwiGLU FFN of width 3D, byte tokens) is trained in float32 (the BF16 row of
`s3req.train`) on the default corpus (Shakespeare) at the learning rate 3e-3 * 128 / D (the
1/width scaling of Adam's rate for hidden weights), for 100 steps of 4 x 64 tokens up to
D = 512 and fewer at D = 1024 (50) and 2048 (25), so that the sweep fits in well under an
hour of a shared 2-core CPU. On each checkpoint the diagnostics of Table II are measured with
the code of `experiments/table2_gradient_error.py` (dX at the input of layer 0 and of the top
layer, dW of the seven projections of layer 0, the embedding gradient: relative Frobenius
error against
the exact float gradient, mean +- standard error over the step keys) for INT8 RTNE,
Independent SR, S3R (Phi2D), S3R (PhiBcast) and S3R-EC dX-only and two-way (Phi2D).

Proposition 1 of the paper: under per-token thresholds the rounding errors of one token's D
output channels share a component, and the dX product `G W` adds it up with the weights
`W_i` (the D output-channel weights of input channel i). With the even-residual covariances
of Lemma 2 (variance Delta^2/6, pair covariance Delta^2/12) the dX error variance of input
channel i is `Delta^2/12 (||W_i||^2 + (W_i 1_D)^2)` under Phi2D against `Delta^2/6 ||W_i||^2`
under independent SR, so the predicted ratio of the error norms is `sqrt((1 + R) / 2)` with
`R = sum_i (W_i 1_D)^2 / sum_i ||W_i||^2`. `R` is 1 for weights without a common component
and grows like D when the rows share one; `R / D` is the fraction of the energy of W in the
common component (the mean over the output channels). The script computes R from each
checkpoint's int8 weight codes (what the dX GEMM multiplies; the per-channel scales are folded
into the gradient) and from the float W, measures the ratio of one GEMM in isolation (the
checkpoint's W, Gaussian x and G: the setting of the proposition) and compares both with the
ratio of the whole model, where the RMSNorm and attention backward passes stand between a
GEMM and the residual stream (the paper: "a mechanism, not an exact model").

    python experiments/table2_width.py            # about 20-40 min on 2 shared CPU cores
    python experiments/table2_width.py --quick --out /tmp/t2w   # seconds: widths 32 and 64

Writes `table2_width.json`, `table2_width.md` and `table2_width.png` into `--out` (default
`docs/results/`).
"""

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import sys
import time

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import table2_gradient_error as t2

import models
import policies
from s3req import absmax_scale, qdot, round_to_int8


ROOT = pathlib.Path(__file__).resolve().parent.parent

# Row id (a name of `policies.PRESETS`) -> label.
ROWS = {
    "rtne": "INT8 RTNE",
    "sr": "Independent SR",
    "s3r": "S3R (Phi2D)",
    "s3r-bcast": "S3R (PhiBcast)",
    "s3r-ec-dx": "S3R-EC, dX-only (Phi2D)",
    "s3r-ec-2way": "S3R-EC, two-way (Phi2D)",
}
KINDS = t2.PROJECTIONS
COLUMN_LABELS = ("dX layer 0", "dX top layer", "dW layer 0", "Emb.")


@dataclasses.dataclass(frozen=True)
class Sweep:
    widths: tuple[int, ...]
    n_layers: int
    steps: tuple[int, ...]  # per width
    batch: int
    seq_len: int
    lr_at_128: float
    eval_batches: int
    meas_batch: int
    meas_seq: int
    n_keys: int
    gemm_keys: int


SWEEPS = {
    "full": Sweep(
        widths=(128, 256, 512, 1024, 2048),
        n_layers=2,
        steps=(100, 100, 100, 50, 25),
        batch=4,
        seq_len=64,
        lr_at_128=3e-3,
        eval_batches=8,
        meas_batch=2,
        meas_seq=64,
        n_keys=8,
        gemm_keys=6,
    ),
    "quick": Sweep(
        widths=(32, 64),
        n_layers=2,
        steps=(3, 2),
        batch=2,
        seq_len=16,
        lr_at_128=3e-3,
        eval_batches=1,
        meas_batch=2,
        meas_seq=16,
        n_keys=3,
        gemm_keys=3,
    ),
}


def model_overrides(width: int, n_layers: int) -> dict:
    """The Llama shape of one width: heads of 32, GQA with half as many kv heads, FFN 3D."""
    if width % 32:
        raise ValueError(f"table2_width: widths must be multiples of 32, got {width}.")
    heads = width // 32
    return {
        "d_model": width,
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": max(1, heads // 2),
        "d_ff": 3 * width,
    }


def layer_weights(model: models.Llama, layer: int) -> dict[str, jax.Array]:
    """The seven projection weights `(out, in)` of one decoder layer."""
    return {kind: w[layer] for kind, w in t2.projections(model).items()}


def row_sum_ratio(w: jax.Array) -> float:
    """`R = sum_i (W_i 1_D)^2 / sum_i ||W_i||^2` of a weight `(out, in)`: `W_i` is column i,
    the D = out weights that multiply one token's D gradient channels in the dX product."""
    w64 = np.asarray(w, np.float64)
    return float((w64.sum(axis=0) ** 2).sum() / (w64**2).sum())


def codes(w: jax.Array) -> jax.Array:
    """The int8 codes of a weight `(out, in)` as the forward pass rounds it (per output
    channel)."""
    return round_to_int8(w, absmax_scale(w, axis=1))


def predicted_ratio(r: float) -> float:
    """Proposition 1 with Lemma 2's even-residual covariances: the ratio of the dX error norms
    of Phi2D and independent SR for a weight with row-sum ratio `r`."""
    return math.sqrt((1.0 + r) / 2.0)


@eqx.filter_jit
def _gemm_dx(x, w, g, key, policy):
    _, vjp = jax.vjp(lambda x_: qdot(x_, w.T, policy=policy, key=key), x)
    return vjp(g)[0]


def gemm_noise(w: jax.Array, policy, x, g, keys) -> np.ndarray:
    """Per key, the squared norm of the dX rounding noise of one GEMM: `||dX_k - mean||^2`,
    scaled by `n / (n - 1)` so that its mean is unbiased."""
    dx = np.stack([np.asarray(_gemm_dx(x, w, g, k, policy), np.float64) for k in keys])
    n = len(keys)
    return ((dx - dx.mean(axis=0)) ** 2).reshape(n, -1).sum(axis=1) * n / (n - 1)


def noise_energy(errs: np.ndarray, floor) -> np.ndarray:
    """Per key, the rounding-noise energy in units of `||exact||^2`, from the relative errors
    `errs[k] = ||g_k - e|| / ||e||` and the bias floor `||mean_k g_k - e|| / ||e||`: since
    `sum_k ||g_k - e||^2 = sum_k ||g_k - mean||^2 + n ||mean - e||^2`, the mean over keys of
    `(errs^2 - floor^2) n / (n - 1)` is the unbiased key-to-key variance of the gradient."""
    n = errs.shape[0]
    return (errs**2 - np.square(floor)) * (n / (n - 1))


def _ratio(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """mean(a) / mean(b) and its delta-method standard error (independent samples)."""
    ma, mb = a.mean(), b.mean()
    ra = a.std(ddof=1) / math.sqrt(a.size) / ma
    rb = b.std(ddof=1) / math.sqrt(b.size) / mb
    q = float(ma / mb)
    return q, q * math.sqrt(ra**2 + rb**2)


def _sqrt_ratio(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """sqrt(mean(a) / mean(b)) (a ratio of noise norms from squared norms) and its error."""
    q, se = _ratio(a, b)
    return math.sqrt(q), 0.5 * se / math.sqrt(q)


def width_config(width: int, sw: Sweep):
    """The training settings of the checkpoint of one width (warmup: a tenth of the steps)."""
    from s3req.train import TrainConfig

    steps = sw.steps[sw.widths.index(width)]
    return TrainConfig(
        policy="bf16",
        steps=steps,
        batch=sw.batch,
        seq_len=sw.seq_len,
        lr=sw.lr_at_128 * 128 / width,
        warmup=max(1, steps // 10),
        eval_every=0,
        eval_batches=sw.eval_batches,
        model=model_overrides(width, sw.n_layers),
    )


def one_width(width: int, sw: Sweep, data, log, check: bool) -> dict:
    """Train the checkpoint of one width and measure everything on it (`check`: also assert
    that the layer-by-layer forward of Table II equals the model's own)."""
    cfg = width_config(width, sw)
    t0 = time.perf_counter()
    result, tokens = t2.train_checkpoint(cfg, data, sw.meas_batch, sw.meas_seq)
    train_s = time.perf_counter() - t0
    trained = result.model
    log(f"width {width}: trained in {train_s:.0f} s, val {result.metrics[-1]['val_loss']:.4f}")
    float_model = t2.with_policy(trained, None)
    if check:
        t2.check_forward(float_model, tokens)
    exact = eqx.filter_jit(t2.gradients)(float_model, tokens, None)
    keys = jr.split(jr.key(2024), sw.n_keys)
    rows = {}
    for rid, label in ROWS.items():
        policy = policies.preset(rid)
        deterministic = isinstance(policy.topology, policies.Nearest)  # pyright: ignore
        errs, floor = t2.measure(
            trained, policy, tokens, keys[:1] if deterministic else keys, exact
        )
        n = errs.shape[0]
        noise = noise_energy(errs, floor) if n > 1 else np.zeros_like(errs)
        rows[rid] = {
            "label": label,
            "n_keys": n,
            "mean": errs.mean(axis=0).tolist(),
            "sem": (errs.std(axis=0, ddof=1) / math.sqrt(n)).tolist() if n > 1 else [0.0] * 4,
            "bias_floor": list(floor),
            "noise": np.sqrt(np.maximum(noise.mean(axis=0), 0.0)).tolist(),
            "_errs": errs,
            "_noise": noise,
        }
        log(f"  {label}: " + ", ".join(f"{v:.4f}" for v in rows[rid]["mean"]))
    ratios = {}
    for rid in ("s3r", "s3r-bcast", "s3r-ec-dx", "s3r-ec-2way"):
        tot = [_ratio(rows[rid]["_errs"][:, j], rows["sr"]["_errs"][:, j]) for j in range(4)]
        noi = [
            _sqrt_ratio(rows[rid]["_noise"][:, j], rows["sr"]["_noise"][:, j]) for j in range(4)
        ]
        ratios[rid] = {
            "total": [t[0] for t in tot],
            "total_se": [t[1] for t in tot],
            "noise": [t[0] for t in noi],
            "noise_se": [t[1] for t in noi],
        }
    for r in rows.values():
        del r["_errs"], r["_noise"]
    # Proposition 1 from the checkpoint's own weights, every projection of every layer.
    weights = {}
    for kind in KINDS:
        per_layer = [layer_weights(trained, layer)[kind] for layer in range(sw.n_layers)]
        r_codes = [row_sum_ratio(codes(w)) for w in per_layer]
        weights[kind] = {
            "d_out": int(per_layer[0].shape[0]),
            "R_codes": r_codes,
            "R_float": [row_sum_ratio(w) for w in per_layer],
            "common_fraction": [r / per_layer[0].shape[0] for r in r_codes],
            "predicted_ratio": [predicted_ratio(r) for r in r_codes],
        }
    pred_all = [p for k in KINDS for p in weights[k]["predicted_ratio"]]
    # One GEMM in isolation: the layer-0 weights with Gaussian x and G (even residuals).
    kx, kg = jr.split(jr.key(7))
    gkeys = jr.split(jr.key(99), sw.gemm_keys)
    gemm = {}
    for kind, w in layer_weights(trained, 0).items():
        shape = (sw.meas_batch, sw.meas_seq)
        x = jr.normal(kx, shape + (w.shape[1],))
        g = jr.normal(kg, shape + (w.shape[0],))
        e_sr = gemm_noise(w, policies.preset("sr"), x, g, gkeys)
        e_2d = gemm_noise(w, policies.preset("s3r"), x, g, gkeys)
        q, se = _sqrt_ratio(e_2d, e_sr)
        gemm[kind] = {"ratio": q, "se": se, "predicted": weights[kind]["predicted_ratio"][0]}
    log(
        f"  Phi2D/SR dX layer 0: {ratios['s3r']['total'][0]:.3f} (noise "
        f"{ratios['s3r']['noise'][0]:.3f}); Prop. 1 over the GEMMs {min(pred_all):.3f}-"
        f"{max(pred_all):.3f}; isolated GEMMs "
        + ", ".join(f"{k} {v['ratio']:.2f}/{v['predicted']:.2f}" for k, v in gemm.items())
    )
    return {
        "width": width,
        "config": cfg.to_dict(),
        "final_val_loss": result.metrics[-1]["val_loss"],
        "train_s": round(train_s, 1),
        "measure_s": round(time.perf_counter() - t0 - train_s, 1),
        "rows": rows,
        "ratios_vs_sr": ratios,
        "weights": weights,
        "predicted_ratio_mean": math.sqrt(float(np.mean(np.square(pred_all)))),
        "predicted_ratio_range": [min(pred_all), max(pred_all)],
        "gemm": gemm,
    }


def _measure_settings(sw: Sweep) -> dict:
    return {k: getattr(sw, k) for k in ("meas_batch", "meas_seq", "n_keys", "gemm_keys")}


def run(sweep_name: str, out: pathlib.Path) -> dict:
    from s3req.train import load_data

    sw = SWEEPS[sweep_name]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(msg):
        print(
            f"[table2_width {time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True
        )

    data = load_data(None)
    # Resumable: every finished width is one JSON line of the runs file, reused by a rerun
    # with the same settings. The order puts the extremes first.
    path = out / f"table2_width_{sweep_name}_runs.jsonl"
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["config"] == width_config(rec["width"], sw).to_dict() and rec.get(
                "measure"
            ) == _measure_settings(sw):
                done[rec["width"]] = rec
    order = sorted(sw.widths, key=lambda w: (w not in (min(sw.widths), max(sw.widths)), w))
    for i, w in enumerate(order):
        if w in done:
            log(f"width {w}: reused from {path.name}")
            continue
        rec = one_width(w, sw, data, log, check=i == 0)
        rec["measure"] = _measure_settings(sw)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        done[w] = rec
    widths = [done[w] for w in sw.widths]
    summary = {
        "sweep": sweep_name,
        "settings": dataclasses.asdict(sw),
        "widths": widths,
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
    }
    (out / "table2_width.json").write_text(json.dumps(summary, indent=1))
    (out / "table2_width.md").write_text(markdown(summary))
    plot(summary, out / "table2_width.png")
    return summary


def _pm(x: float, se: float, spec: str = ".3f") -> str:
    return f"{x:{spec}} +- {se:{spec}}"


def markdown(s: dict) -> str:
    sw, ws = s["settings"], s["widths"]
    cmd = "python experiments/table2_width.py" + (" --quick" if s["sweep"] == "quick" else "")
    top = sw["n_layers"] - 1
    lines = [
        "# Table II across widths: the Phi2D dX penalty and Proposition 1",
        "",
        f"Generated by `{cmd}` ({sum(w['train_s'] + w['measure_s'] for w in ws) / 60:.0f} min of "
        f"training and measuring on this machine; {s['device']}, jax "
        f"{s['jax']}). The method and the formulas are in the script's docstring.",
        "",
        f"Checkpoints: {sw['n_layers']}-layer Llamas (heads of 32, n_kv_heads = n_heads / 2, "
        f"SwiGLU width 3D, byte tokens), trained in float32 (the BF16 row) on Shakespeare for "
        f"the steps below of {sw['batch']} x {sw['seq_len']} tokens, AdamW at the peak rate "
        "3e-3 x 128 / D, warmup a tenth of the steps + cosine decay. This is short training: "
        "the checkpoints are far from converged, and the wide ones (smaller rate, fewer steps, "
        "to fit the CPU) are the least trained. Times: on the shared CPU, under the load of "
        "other jobs.",
        "",
        "| width D | parameters | steps (tokens) | peak LR | val loss | training (s) | "
        "measuring (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in ws:
        c = dataclasses.replace(models.get_config(w["config"]["preset"]), **w["config"]["model"])
        n = models.count_params(c)
        lines.append(
            f"| {w['width']} | {n / 1e6:.2f} M | {w['config']['steps']} "
            f"({w['config']['steps'] * sw['batch'] * sw['seq_len']:,}) "
            f"| {w['config']['lr']:.3g} | "
            f"{w['final_val_loss']:.3f} | {w['train_s']:.0f} | {w['measure_s']:.0f} |"
        )
    lines += [
        "",
        f"Diagnostics as in [Table II](table2.md): one fixed validation batch of "
        f"{sw['meas_batch']} x {sw['meas_seq']} tokens, {sw['n_keys']} step keys per stochastic "
        "policy (INT8 RTNE is deterministic: one key), relative Frobenius error against the "
        "exact float32 gradient of the same weights, mean +- standard error over keys.",
        "",
    ]
    for j, col in enumerate(COLUMN_LABELS):
        name = col.replace("top layer", f"top layer (layer {top})")
        lines += [
            f"### {name}",
            "",
            "| configuration | " + " | ".join(f"D = {w['width']}" for w in ws) + " |",
            "| --- | " + " | ".join("---:" for _ in ws) + " |",
        ]
        for rid, label in ROWS.items():
            cells = [_pm(w["rows"][rid]["mean"][j], w["rows"][rid]["sem"][j], ".4f") for w in ws]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## The Phi2D / SR ratio against Proposition 1",
        "",
        "Ratios to Independent SR at the input of layer 0 (+- delta-method standard error). "
        "*Total*: the ratio of the errors above (they include the bias floor of the INT8 "
        "forward pass, the same for every policy). *Noise*: the ratio of the rounding noise "
        "alone (the key-to-key spread, `sqrt(mean err^2 - floor^2)`), what the proposition is "
        "about. *Isolated GEMM*: one layer-0 projection with the checkpoint's W and Gaussian x "
        f"and G, {sw['gemm_keys']} keys, the ratio of the dX noise norms (mean over the seven "
        "projections of their ratios). *Prop. 1*: `sqrt((1 + R) / 2)` from the int8 codes of "
        "W, the root mean square over the seven projections of every layer, and its range.",
        "",
        "| width D | S3R (Phi2D) / SR, total | noise | isolated GEMM (measured) | "
        "isolated GEMM (Prop. 1) | Prop. 1, all GEMMs: rms [range] | EC dX-only / SR, total "
        "| EC two-way / SR, total | PhiBcast / SR, total |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in ws:
        r = w["ratios_vs_sr"]
        g = w["gemm"]
        gm = float(np.mean([v["ratio"] for v in g.values()]))
        gp = float(np.mean([v["predicted"] for v in g.values()]))
        lo, hi = w["predicted_ratio_range"]
        lines.append(
            f"| {w['width']} | {_pm(r['s3r']['total'][0], r['s3r']['total_se'][0])} | "
            f"{_pm(r['s3r']['noise'][0], r['s3r']['noise_se'][0])} | {gm:.3f} | {gp:.3f} | "
            f"{w['predicted_ratio_mean']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{_pm(r['s3r-ec-dx']['total'][0], r['s3r-ec-dx']['total_se'][0])} | "
            f"{_pm(r['s3r-ec-2way']['total'][0], r['s3r-ec-2way']['total_se'][0])} | "
            f"{_pm(r['s3r-bcast']['total'][0], r['s3r-bcast']['total_se'][0])} |"
        )
    lines += [
        "",
        "Isolated GEMMs, per projection of layer 0: measured Phi2D / SR noise ratio (Prop. 1 "
        "in brackets):",
        "",
        "| width D | " + " | ".join(KINDS) + " |",
        "| ---: | " + " | ".join("---:" for _ in KINDS) + " |",
    ]
    for w in ws:
        g = w["gemm"]
        lines.append(
            f"| {w['width']} | "
            + " | ".join(f"{g[k]['ratio']:.3f} ({g[k]['predicted']:.3f})" for k in KINDS)
            + " |"
        )
    lines += [
        "",
        "## The common component of the rows of W",
        "",
        "Per projection kind, the fraction `R / D` of the energy of the int8 weight codes that "
        "lies in the mean over the D output channels (mean over the layers; 1 / D for weights "
        "without a common component, i.e. R = 1), and in brackets R itself (float W: the "
        "JSON's `R_float`). The predicted ratio grows with the width only where R does.",
        "",
        "| width D | " + " | ".join(KINDS) + " |",
        "| ---: | " + " | ".join("---:" for _ in KINDS) + " |",
    ]
    for w in ws:
        cells = []
        for k in KINDS:
            v = w["weights"][k]
            cells.append(f"{np.mean(v['common_fraction']):.2e} ({np.mean(v['R_codes']):.2f})")
        lines.append(f"| {w['width']} | " + " | ".join(cells) + " |")
    lines += ["", _reading(s), "", "![error vs width](table2_width.png)", ""]
    return "\n".join(lines)


def _reading(s: dict) -> str:
    ws = s["widths"]
    a, b = ws[0], ws[-1]

    def tot(w, rid="s3r"):
        return w["ratios_vs_sr"][rid]["total"][0]

    def noi(w):
        return w["ratios_vs_sr"]["s3r"]["noise"][0]

    def gm(w):
        return float(np.mean([v["ratio"] for v in w["gemm"].values()]))

    def gp(w):
        return float(np.mean([v["predicted"] for v in w["gemm"].values()]))

    def top_kind(w):
        return max(KINDS, key=lambda k: float(np.mean(w["weights"][k]["R_codes"])))

    def big_r(w, k):
        return float(np.mean(w["weights"][k]["R_codes"]))

    ka, kb = top_kind(a), top_kind(b)
    over = [w["width"] for w in ws if tot(w) >= 1.3]
    ec_below = [w["width"] for w in ws if tot(w, "s3r-ec-2way") < 1.0]
    return (
        "Reading (generated from the numbers above): from D = "
        f"{a['width']} to D = {b['width']} the S3R (Phi2D) / Independent SR ratio of the "
        f"layer-0 dX error goes from {tot(a):.3f} to {tot(b):.3f}, a factor "
        f"{tot(b) / tot(a):.3f} over a {b['width'] // a['width']}x wider model (noise alone: "
        f"{noi(a):.3f} to {noi(b):.3f}). Proposition 1 from the checkpoints' own weights predicts "
        f"{a['predicted_ratio_mean']:.3f} to {b['predicted_ratio_mean']:.3f} (rms over all "
        f"GEMMs); for the layer-0 GEMMs in isolation it predicts {gp(a):.3f} to {gp(b):.3f} and "
        f"the measurement gives {gm(a):.3f} to {gm(b):.3f}. The largest common component of "
        f"the weight rows is that of `{ka}` at D = {a['width']} (R = {big_r(a, ka):.2f}, "
        f"R / D = {big_r(a, ka) / a['weights'][ka]['d_out']:.1e}) and of `{kb}` at "
        f"D = {b['width']} (R = {big_r(b, kb):.2f}, "
        f"R / D = {big_r(b, kb) / b['weights'][kb]['d_out']:.1e}): where R stays near 1 the "
        "proposition predicts no penalty, whatever the width. Widths with a total ratio >= 1.3: "
        f"{', '.join(map(str, over)) if over else 'none'}. The two-way correction is below "
        f"Independent SR at the layer-0 dX at widths "
        f"{', '.join(map(str, ec_below)) if ec_below else 'none'}."
    )


def plot(s: dict, path: pathlib.Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ws = s["widths"]
    d = [w["width"] for w in ws]
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    for j, col in enumerate(COLUMN_LABELS):
        ax = axes[j]
        for rid, label in ROWS.items():
            m = [w["rows"][rid]["mean"][j] for w in ws]
            e = [w["rows"][rid]["sem"][j] for w in ws]
            ax.errorbar(d, m, yerr=e, marker="o", ms=4, capsize=2, label=label)
        ax.set_title(f"{col}: relative error")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width D")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    ax = axes[4]
    r = [w["ratios_vs_sr"]["s3r"] for w in ws]
    for key, marker, label in (("total", "o", "total error"), ("noise", "s", "noise only")):
        m, e = [x[key][0] for x in r], [x[f"{key}_se"][0] for x in r]
        ax.errorbar(d, m, yerr=e, marker=marker, capsize=2, label=f"model, {label}")
    ax.plot(
        d,
        [np.mean([v["ratio"] for v in w["gemm"].values()]) for w in ws],
        "^-",
        label="isolated layer-0 GEMMs (mean)",
    )
    ax.plot(
        d,
        [np.mean([v["predicted"] for v in w["gemm"].values()]) for w in ws],
        "^--",
        label="Prop. 1, layer-0 GEMMs (mean)",
    )
    ax.plot(d, [w["predicted_ratio_mean"] for w in ws], "k--", label="Prop. 1, all GEMMs (rms)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("S3R (Phi2D) / Independent SR, dX layer 0")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("width D")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[5]
    for k in KINDS:
        ax.plot(d, [np.mean(w["weights"][k]["R_codes"]) for w in ws], "o-", label=k)
    ax.axhline(1.0, color="k", ls=":", label="R = 1 (no common component)")
    ax.set_title("row-sum ratio R of the int8 W codes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("width D")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Table II across widths ({s['sweep']} sweep)")
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="widths 32 and 64, a few steps (seconds)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    summary = run("quick" if args.quick else "full", pathlib.Path(args.out))
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
