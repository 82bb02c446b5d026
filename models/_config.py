"""Model configurations: `LlamaConfig`, `MoEConfig`, `RopeScaling` (frozen, hashable)."""

import dataclasses
import math
from typing import Literal


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The Llama-3 rotary-frequency scaling (Hugging Face `rope_type: "llama3"`).

    Wavelengths longer than `original_max_seq_len / low_freq_factor` are divided by `factor`,
    those shorter than `original_max_seq_len / high_freq_factor` are kept, and the band in
    between is interpolated smoothly.

    **Arguments:**

    - `factor`: how much the longest wavelengths are stretched (8 for Llama 3.1).
    - `low_freq_factor`, `high_freq_factor`: the band edges (1 and 4 for Llama 3.1).
    - `original_max_seq_len`: the context length of pre-training (8192 for Llama 3.1).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self):
        if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling: need factor > 0 and high_freq_factor > low_freq_factor, got {self}."
            )


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts FFN of a decoder layer (Qwen3-MoE / DeepSeek-MoE style).

    Every token's router (a float linear map) picks `top_k` of `n_experts` SwiGLU experts of
    width `d_expert` by softmax probability; their outputs are summed with those
    probabilities (renormalised over the chosen `top_k` when `norm_topk_prob`). Optional
    shared experts see every token. No token is ever dropped.

    **Arguments:**

    - `n_experts`: routed experts per layer.
    - `top_k`: experts per token.
    - `d_expert`: hidden width of each routed expert.
    - `n_shared_experts`: shared experts (run as one SwiGLU FFN of width
      `n_shared_experts * d_expert`, as DeepSeek does). Default 0.
    - `aux_loss_coef`: weight $\\alpha$ of the load-balancing loss
      $E \\sum_e f_e P_e$ (fraction of routed (token, slot) pairs times mean router
      probability; equals `top_k` when perfectly balanced). Default 0.001 (Qwen3-MoE).
    - `z_loss_coef`: weight $\\beta$ of the router z-loss
      $\\operatorname{mean}_t (\\log \\sum_e e^{z_{t,e}})^2$. Default 0.
    - `norm_topk_prob`: renormalise the chosen `top_k` probabilities to sum to one.
    - `n_dense_layers`: the first `n_dense_layers` layers use a dense SwiGLU FFN of width
      `LlamaConfig.d_ff` instead (DeepSeek's `first_k_dense_replace`). Default 0.
    """

    n_experts: int
    top_k: int
    d_expert: int
    n_shared_experts: int = 0
    aux_loss_coef: float = 0.001
    z_loss_coef: float = 0.0
    norm_topk_prob: bool = True
    n_dense_layers: int = 0

    def __post_init__(self):
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"MoEConfig: need 1 <= top_k <= n_experts, got top_k={self.top_k}, "
                f"n_experts={self.n_experts}."
            )
        if self.d_expert < 1 or self.n_shared_experts < 0 or self.n_dense_layers < 0:
            raise ValueError(
                "MoEConfig: d_expert must be positive and n_shared_experts, n_dense_layers "
                f"non-negative, got {self}."
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape and options of a Llama-style decoder (frozen and hashable: `jax.jit` can
    treat it as static; change it with `dataclasses.replace`).

    **Arguments:**

    - `vocab_size`: number of token ids.
    - `max_seq_len`: the longest sequence the model accepts.
    - `d_model`: width of the residual stream.
    - `n_layers`: decoder layers.
    - `n_heads`: query heads.
    - `n_kv_heads`: key/value heads (grouped-query attention; divides `n_heads`).
    - `d_ff`: hidden width of the SwiGLU FFN (of the dense layers, when `moe` is set).
    - `head_dim`: width of a head; `None` (default) means `d_model // n_heads`. Read the
      resolved value from `d_head`.
    - `rope_theta`: RoPE base.
    - `rope_scaling`: optional Llama-3 frequency scaling, a [`models.RopeScaling`][].
    - `qk_norm`: RMSNorm on every query and key head before RoPE (Qwen3).
    - `tie_embeddings`: the output head reuses the embedding matrix.
    - `norm_eps`: RMSNorm epsilon.
    - `compute_dtype`: `"float32"` or `"bfloat16"`: the dtype of the activations. Parameters
      stay float32 and are cast at use; logits are float32.
    - `remat`: rematerialise every layer in the backward pass (`jax.checkpoint`).
    - `moe`: a [`models.MoEConfig`][] to use mixture-of-experts FFNs, or `None` (dense).
    """

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    moe: MoEConfig | None = None

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig: `{name}` must be positive, got {self}.")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                f"({self.n_heads})."
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"LlamaConfig: d_model ({self.d_model}) is not a multiple of n_heads "
                f"({self.n_heads}); set head_dim explicitly."
            )
        if self.d_head % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even for RoPE, got {self.d_head}.")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                "LlamaConfig: compute_dtype must be 'float32' or 'bfloat16', got "
                f"{self.compute_dtype!r}."
            )
        if self.moe is not None and self.moe.n_dense_layers > self.n_layers:
            raise ValueError(
                f"LlamaConfig: moe.n_dense_layers ({self.moe.n_dense_layers}) exceeds "
                f"n_layers ({self.n_layers})."
            )
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 1:
            raise ValueError(f"LlamaConfig: rope_theta must be > 1, got {self.rope_theta}.")

    @property
    def d_head(self) -> int:
        """The resolved head width (`head_dim`, or `d_model // n_heads`)."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def n_dense_layers(self) -> int:
        """Layers with a dense SwiGLU FFN (all of them when `moe` is `None`)."""
        return self.n_layers if self.moe is None else self.moe.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        """Layers with a mixture-of-experts FFN."""
        return self.n_layers - self.n_dense_layers


def count_params(config: LlamaConfig, *, active: bool = False) -> int:
    """The number of parameters of `Llama(config, ...)`.

    **Arguments:**

    - `config`: the model configuration.
    - `active`: count only the parameters one token uses (routed experts: `top_k` of
      `n_experts`). (Keyword only argument.)

    **Returns:**

    The parameter count (embedding and output head included; a tied head counted once).
    """
    c = config
    d, hd = c.d_model, c.d_head
    attn = d * hd * (2 * c.n_heads + 2 * c.n_kv_heads) + (2 * hd if c.qk_norm else 0)
    per_layer = attn + 2 * d
    total = c.n_layers * per_layer
    total += c.n_dense_layers * 3 * d * c.d_ff
    if c.moe is not None:
        m = c.moe
        experts = m.top_k if active else m.n_experts
        moe = m.n_experts * d + experts * 3 * d * m.d_expert
        moe += 3 * d * m.n_shared_experts * m.d_expert
        total += c.n_moe_layers * moe
    total += c.vocab_size * d * (1 if c.tie_embeddings else 2) + d
    return total


def flops_per_token(config: LlamaConfig, *, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM way.

    $6 N + 12\\, L\\, H\\, d_\\text{head}\\, T$, with $N$ the parameters of the matmuls one token
    uses (projections, active experts, router, output head; not the embedding lookup or the
    norms) and the second term the attention products (non-causal count, as in PaLM).

    **Arguments:**

    - `config`: the model configuration.
    - `seq_len`: sequence length $T$ of the attention term (default `config.max_seq_len`).
      (Keyword only argument.)

    **Returns:**

    FLOPs per token, a Python float.
    """
    c = config
    t = c.max_seq_len if seq_len is None else seq_len
    n = count_params(c, active=True)
    n -= c.vocab_size * c.d_model * (0 if c.tie_embeddings else 1)  # the embedding lookup
    n -= c.n_layers * 2 * c.d_model + c.d_model + (2 * c.d_head * c.n_layers if c.qk_norm else 0)
    return float(6 * n + 12 * c.n_layers * c.n_heads * c.d_head * t)
