"""Loading a trained run and sampling text from it."""

import pathlib

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import PRNGKeyArray

from ._checkpoint import load_checkpoint, load_meta
from ._config import build_model, TrainConfig
from ._tokenizer import AbstractTokenizer, load_tokenizer


TOKENIZER_FILE = "tokenizer.json"


def load_run(
    out: str | pathlib.Path,
) -> tuple[eqx.Module, AbstractTokenizer | None, TrainConfig]:
    """Load the model, tokenizer and config of a run folder written by `train`.

    **Arguments:**

    - `out`: the run folder (or its `checkpoint/` subfolder).

    **Returns:**

    `(model, tokenizer or None for pre-tokenized data, config)`.
    """
    out = pathlib.Path(out)
    if out.name == "checkpoint" or out.parent.name == "checkpoint":
        out = out.parent if out.name == "checkpoint" else out.parent.parent
    meta = load_meta(out)
    config = TrainConfig.from_dict(meta["config"])
    init_key = jr.split(jr.key(config.seed), 3)[0]
    like = eqx.filter_eval_shape(build_model, config, meta["vocab_size"], key=init_key)
    model, _, _ = load_checkpoint(out, like)
    tok_file = out / TOKENIZER_FILE
    tokenizer = load_tokenizer(tok_file) if tok_file.is_file() else None
    return model, tokenizer, config


@eqx.filter_jit
def _next_token(model, buf, pos, key, temperature):
    logits = model(buf, key=key)[0, pos]
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    return jr.categorical(key, logits / temperature).astype(jnp.int32)


def sample(
    model: eqx.Module,
    tokenizer: AbstractTokenizer | None,
    prompt: str,
    *,
    tokens: int = 200,
    temperature: float = 0.8,
    context: int | None = None,
    key: PRNGKeyArray,
) -> str:
    """Generate a continuation of `prompt`.

    **Arguments:**

    - `model`: a trained model (`models.Llama`).
    - `tokenizer`: the run's tokenizer; `None` for pre-tokenized data, in which case `prompt`
      and the result are whitespace-separated token ids.
    - `prompt`: the text to continue (an empty prompt starts from a newline).
    - `tokens`: how many tokens to generate.
    - `temperature`: softmax temperature; `0` is greedy (argmax) decoding.
    - `context`: the window the model sees (default: its `max_seq_len`); use the training
      `seq_len`.
    - `key`: sampling key; token `i` uses `fold_in(key, i)`. (Keyword only argument.)

    **Returns:**

    The generated continuation (without the prompt).
    """
    if tokens < 0:
        raise ValueError(f"sample: tokens must be >= 0, got {tokens}.")
    if temperature < 0:
        raise ValueError(f"sample: temperature must be >= 0 (0 is greedy), got {temperature}.")
    max_len = model.config.max_seq_len  # pyright: ignore[reportAttributeAccessIssue]
    context = max_len if context is None else min(context, max_len)
    if tokenizer is None:
        ids = [int(t) for t in prompt.split()]
    else:
        ids = [int(t) for t in tokenizer.encode(prompt if prompt else "\n")]
    if not ids:
        raise ValueError("sample: give a prompt (token ids for pre-tokenized data).")
    n_prompt = len(ids)
    buf = np.zeros((1, context), np.int32)
    for i in range(tokens):
        window = ids[-context:]
        buf[0, :] = 0
        buf[0, : len(window)] = window
        t = _next_token(
            model,
            jnp.asarray(buf),
            jnp.asarray(len(window) - 1, jnp.int32),
            jr.fold_in(key, i),
            float(temperature),
        )
        ids.append(int(t))
    new = ids[n_prompt:]
    if tokenizer is None:
        return " ".join(str(t) for t in new)
    full = tokenizer.decode(np.asarray(ids))
    head = tokenizer.decode(np.asarray(ids[:n_prompt]))
    return full[len(head) :] if full.startswith(head) else tokenizer.decode(np.asarray(new))
