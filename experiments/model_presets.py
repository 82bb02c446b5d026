"""The table of model presets: parameters, active parameters, training FLOPs per token and,
optionally, the compile-only memory of one training step (no device memory is used).

    python experiments/model_presets.py              # the table of docs/guides/models.md
    python experiments/model_presets.py --memory     # + compile-only step memory (minutes)

Prints a Markdown table to stdout (and writes it to `--out` if given).
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from models import count_params, flops_per_token, get_config, Llama, PRESETS
from policies import Phi2D, Policy, TwoWayEC


def step_memory(name: str, batch: int, seq: int) -> float:
    """GiB of arguments + temporaries of a compiled loss-and-grad step on abstract inputs."""
    cfg = get_config(name)
    model = eqx.filter_eval_shape(Llama, cfg, Policy(Phi2D(), TwoWayEC()), key=jr.key(0))
    dynamic, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def loss(d, tokens, key):
        logits, aux = eqx.combine(d, static).forward(tokens, key=key)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + aux

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    key = jax.eval_shape(lambda: jr.key(0))
    compiled = jax.jit(jax.value_and_grad(loss)).lower(dynamic, tokens, key).compile()
    mem = compiled.memory_analysis()
    if mem is None:
        return float("nan")
    return (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / 2**30


def _si(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def table(memory: bool, batch: int, seq: int) -> str:
    head = (
        "| preset | layers | d_model | heads (kv) | FFN | params | active | FLOPs/token (T=4096) |"
    )
    rule = "|---|---|---|---|---|---|---|---|"
    if memory:
        head += f" step memory, B={batch} T={seq} |"
        rule += "---|"
    rows = [head, rule]
    for name, c in PRESETS.items():
        if c.moe is None:
            ffn = f"SwiGLU {c.d_ff}"
        else:
            m = c.moe
            ffn = f"{m.n_experts} experts top-{m.top_k} x {m.d_expert}"
            ffn += f" + {m.n_shared_experts} shared" if m.n_shared_experts else ""
            ffn += f", {m.n_dense_layers} dense" if m.n_dense_layers else ""
        row = (
            f"| `{name}` | {c.n_layers} | {c.d_model} | {c.n_heads} ({c.n_kv_heads}) | {ffn} | "
            f"{_si(count_params(c))} | {_si(count_params(c, active=True))} | "
            f"{flops_per_token(c, seq_len=4096) / 1e9:.3g} G |"
        )
        if memory:
            row += f" {step_memory(name, batch, seq):.1f} GiB |"
        rows.append(row)
    return "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--memory", action="store_true", help="add compile-only step memory")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args()
    text = table(args.memory, args.batch, args.seq)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
