"""Named model configurations: tiny ones that train on CPU and the shapes of real models.

The large presets are shape-exact copies of the Hugging Face configurations of
Llama 3.1-8B, Qwen3-8B and Qwen3-30B-A3B, and a DeepSeek-V2-Lite-like MoE (see `PRESETS`).
They use bfloat16 activations and full rematerialisation, as in the paper's step-time
benchmarks; build them abstractly with `equinox.filter_eval_shape` on a CPU.
"""

from ._config import LlamaConfig, MoEConfig, RopeScaling


_BIG = dict(compute_dtype="bfloat16", remat=True)

PRESETS: dict[str, LlamaConfig] = {
    # Trains on a CPU in minutes (0.85M parameters).
    "tiny": LlamaConfig(
        vocab_size=256,
        max_seq_len=256,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=384,
    ),
    # Qwen3-MoE style: QK-norm, 8 experts, top-2, no shared experts.
    "tiny-moe": LlamaConfig(
        vocab_size=256,
        max_seq_len=256,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=384,
        qk_norm=True,
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=128, aux_loss_coef=0.01, z_loss_coef=0.001),
    ),
    # A ~100M-parameter Llama (GPT-2-small-like widths) for a single accelerator.
    "small": LlamaConfig(
        vocab_size=32_768,
        max_seq_len=1024,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        d_ff=2048,
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": LlamaConfig(
        vocab_size=128_256,
        max_seq_len=131_072,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14_336,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        norm_eps=1e-5,
        **_BIG,  # pyright: ignore[reportArgumentType]
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": LlamaConfig(
        vocab_size=151_936,
        max_seq_len=40_960,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12_288,
        rope_theta=1_000_000.0,
        qk_norm=True,
        norm_eps=1e-6,
        **_BIG,  # pyright: ignore[reportArgumentType]
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts, top-8, every layer MoE.
    "qwen3-30b-a3b": LlamaConfig(
        vocab_size=151_936,
        max_seq_len=40_960,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        rope_theta=1_000_000.0,
        qk_norm=True,
        norm_eps=1e-6,
        moe=MoEConfig(n_experts=128, top_k=8, d_expert=768, norm_topk_prob=True),
        **_BIG,  # pyright: ignore[reportArgumentType]
    ),
    # DeepSeek-V2-Lite-like: the real model's MoE shapes (64 routed experts, top-6, 2 shared,
    # first layer dense), but multi-head latent attention (MLA) is replaced by plain
    # multi-head attention with head_dim 128 and no YaRN (context 4096).
    "deepseek-v2-lite": LlamaConfig(
        vocab_size=102_400,
        max_seq_len=4096,
        d_model=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        head_dim=128,
        d_ff=10_944,
        rope_theta=10_000.0,
        norm_eps=1e-6,
        moe=MoEConfig(
            n_experts=64,
            top_k=6,
            d_expert=1408,
            n_shared_experts=2,
            norm_topk_prob=False,
            n_dense_layers=1,
        ),
        **_BIG,  # pyright: ignore[reportArgumentType]
    ),
}
"""The named configurations of [`models.get_config`][]."""


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
