"""The Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU or MoE FFNs."""

import functools as ft
import math
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from s3req import AbstractPolicy, QuantLinear

from ._config import LlamaConfig, RopeScaling
from ._ffn import FFN
from ._moe import MoE
from ._sharding import embed_tokens, shard_batch


_F32 = jnp.float32


def _dtype(name: str) -> typing.Any:
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


@typing.final
class RMSNorm(eqx.Module):
    """Root-mean-square layer norm, $y = w \\odot x / \\sqrt{\\operatorname{mean}(x^2) +
    \\epsilon}$, computed in float32 and returned in the dtype of `x`.

    **Arguments:**

    - `dim`: the normalised (last) axis.
    - `eps`: $\\epsilon$.
    - `dtype`: parameter dtype (default float32).
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5, dtype: typing.Any = None):
        self.weight = jnp.ones((dim,), jnp.float32 if dtype is None else dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """Normalise the last axis of `x`."""
        x32 = x.astype(_F32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight.astype(_F32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (y * w).astype(x.dtype)


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """The `head_dim // 2` rotary inverse frequencies (float32 NumPy), with the optional
    Llama-3 scaling applied exactly as Hugging Face's `rope_type="llama3"`."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        s = scaling
        low_wl = s.original_max_seq_len / s.low_freq_factor
        high_wl = s.original_max_seq_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / s.factor, inv)
        smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _rope_tables(config: LlamaConfig, seq: int) -> tuple[Array, Array]:
    inv = jnp.asarray(rope_frequencies(config.d_head, config.rope_theta, config.rope_scaling))
    angles = jnp.outer(jnp.arange(seq, dtype=_F32), inv)  # (S, hd/2)
    return jnp.cos(angles), jnp.sin(angles)


def _apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate `x` (B, S, heads, hd) by position, rotate-half convention (Hugging Face)."""
    half = x.shape[-1] // 2
    x32 = x.astype(_F32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _split(key: PRNGKeyArray | None, n: int) -> list:
    return [None] * n if key is None else list(jr.split(key, n))


@typing.final
class Attention(eqx.Module):
    """Causal grouped-query self-attention with RoPE and optional QK-norm (Qwen3).

    The four projections are bias-free [`s3req.QuantLinear`][]s; the attention products
    (scores and the weighted sum of values) stay in float, with a float32 softmax.

    **Arguments:**

    - `config`: the model configuration (`d_model`, `n_heads`, `n_kv_heads`, `head_dim`,
      `qk_norm`, `norm_eps`).
    - `policy`: the rounding policy of the projections, or `None`.
    - `key`: initialisation key. (Keyword only argument.)
    """

    q_proj: QuantLinear
    k_proj: QuantLinear
    v_proj: QuantLinear
    o_proj: QuantLinear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, policy: AbstractPolicy | None, *, key: PRNGKeyArray):
        c = config
        hd = c.d_head
        kq, kk, kv, ko = jr.split(key, 4)
        linear = ft.partial(QuantLinear, policy=policy, use_bias=False)
        self.q_proj = linear(c.d_model, c.n_heads * hd, key=kq)
        self.k_proj = linear(c.d_model, c.n_kv_heads * hd, key=kk)
        self.v_proj = linear(c.d_model, c.n_kv_heads * hd, key=kv)
        self.o_proj = linear(c.n_heads * hd, c.d_model, key=ko)
        self.q_norm = RMSNorm(hd, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(hd, c.norm_eps) if c.qk_norm else None
        self.n_heads = c.n_heads
        self.n_kv_heads = c.n_kv_heads
        self.head_dim = hd

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        cos: Float[Array, "seq half"],
        sin: Float[Array, "seq half"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "batch seq d_model"]:
        """Attend causally over `x`; `cos`, `sin` are the RoPE tables of the positions.

        `key` is split into one key per projection (required when the policy is
        stochastic). (Keyword only argument.)
        """
        B, S, _ = x.shape
        H, K, hd = self.n_heads, self.n_kv_heads, self.head_dim
        kq, kk, kv, ko = _split(key, 4)
        q = shard_batch(self.q_proj(x, key=kq).reshape(B, S, H, hd))
        k = shard_batch(self.k_proj(x, key=kk).reshape(B, S, K, hd))
        v = shard_batch(self.v_proj(x, key=kv).reshape(B, S, K, hd))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        return self.o_proj(_attend(q, k, v), key=ko)


def _attend(q: Array, k: Array, v: Array) -> Array:
    """Causal grouped-query attention of RoPE'd heads `q` (B, S, H, hd), `k`, `v`
    (B, S, K, hd): float32 scores and softmax, then (B, S, H * hd) in the dtype of `v`.

    Not `jax.nn.dot_product_attention`: its forward is bitwise equal to this one on CPU, but
    its gradients of q and k differ by rounding (tests/test_attention.py measures it), so
    switching would change every training run."""
    B, S, H, hd = q.shape
    K = k.shape[2]
    q = q.reshape(B, S, K, H // K, hd)  # query head h uses kv head h // (H // K)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=_F32)
    scores = scores * (1.0 / math.sqrt(hd))
    causal = jnp.tril(jnp.ones((1, 1, 1, S, S), jnp.bool_))
    scores = jnp.where(causal, scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(B, S, H * hd)


@typing.final
class DecoderLayer(eqx.Module):
    """One pre-norm decoder layer: `x + attn(norm(x))`, then `x + ffn(norm(x))`.

    The FFN is a SwiGLU [`models.FFN`][] or, for mixture-of-experts layers, a
    [`models.MoE`][].

    **Arguments:**

    - `config`: the model configuration.
    - `policy`: the rounding policy of every projection, or `None`.
    - `moe`: whether this layer's FFN is a mixture of experts (needs `config.moe`).
      (Keyword only argument.)
    - `key`: initialisation key. (Keyword only argument.)
    """

    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: FFN | MoE

    def __init__(
        self,
        config: LlamaConfig,
        policy: AbstractPolicy | None,
        *,
        moe: bool = False,
        key: PRNGKeyArray,
    ):
        ka, kf = jr.split(key)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, policy, key=ka)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        if moe:
            if config.moe is None:
                raise ValueError("DecoderLayer: moe=True needs config.moe to be set.")
            self.mlp = MoE(config.d_model, config.moe, policy, key=kf)
        else:
            self.mlp = FFN(config.d_model, config.d_ff, policy, key=kf)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        cos: Float[Array, "seq half"],
        sin: Float[Array, "seq half"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq d_model"], Float[Array, ""]]:
        """Apply the layer. Returns the new residual stream and the layer's auxiliary loss
        (0 for a dense FFN). `key` is split between attention and FFN. (Keyword only.)"""
        ka, kf = _split(key, 2)
        x = shard_batch(x)
        x = shard_batch(x + self.attn(self.attn_norm(x), cos, sin, key=ka))
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp.forward(h, key=kf)
        else:
            y, aux = self.mlp(h, key=kf), jnp.zeros((), _F32)
        return shard_batch(x + y), aux


def _policies(tree) -> list[AbstractPolicy]:
    is_policy = lambda n: isinstance(n, AbstractPolicy)
    return [p for p in jtu.tree_leaves(tree, is_leaf=is_policy) if is_policy(p)]


@typing.final
class Llama(eqx.Module):
    """A Llama-style decoder whose every projection is a quantized [`s3req.QuantLinear`][].

    Token embedding, then `n_layers` pre-norm layers (RMSNorm, causal grouped-query attention
    with RoPE, SwiGLU FFN or mixture of experts), a final RMSNorm and a tied or untied output
    head. The q, k, v, o, gate, up and down projections (and the routed experts) run in INT8
    with the model's policy; the embedding, the attention products, the router and the
    logits stay in float. Layers are stacked (one pytree with a leading layer axis, built
    with `equinox.filter_vmap`) and run with `jax.lax.scan`, so compile time does not grow
    with depth.

    **Arguments:**

    - `config`: a [`models.LlamaConfig`][], e.g. `get_config("tiny")`.
    - `policy`: the rounding policy, e.g. `Policy(Phi2D(), TwoWayEC())`, or `None` for a
      plain float model.
    - `key`: initialisation key. (Keyword only argument.)

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        from models import Llama, get_config
        from policies import Policy, Phi2D, TwoWayEC

        init_key, step_key = jr.split(jr.key(seed := 0))
        model = Llama(get_config("tiny"), Policy(Phi2D(), TwoWayEC()), key=init_key)
        tokens = jnp.zeros((2, 16), jnp.int32)
        logits = model(tokens, key=step_key)   # (2, 16, 256) float32
        ```
    """

    embed: Float[Array, "vocab d_model"]
    layers: tuple[DecoderLayer, ...]
    norm: RMSNorm
    head: Float[Array, "vocab d_model"] | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, policy: AbstractPolicy | None, *, key: PRNGKeyArray):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama: `config` must be a LlamaConfig, got {type(config)}.")
        c = config
        ke, kh, kl = jr.split(key, 3)
        self.embed = 0.02 * jr.normal(ke, (c.vocab_size, c.d_model), _F32)
        self.head = (
            None if c.tie_embeddings else 0.02 * jr.normal(kh, (c.vocab_size, c.d_model), _F32)
        )
        stacks = []
        n_dense = c.n_dense_layers
        for moe, n, k in ((False, n_dense, kl), (True, c.n_layers - n_dense, jr.fold_in(kl, 1))):
            if n:
                make = lambda k, moe=moe: DecoderLayer(c, policy, moe=moe, key=k)
                abstract = eqx.filter_eval_shape(eqx.filter_vmap(make), jr.split(k, n))
                stacks.append(_init_stack(abstract, k))
        self.layers = tuple(stacks)
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.config = c

    def __call__(
        self, tokens: Int[Array, "batch seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "batch seq vocab"]:
        """The float32 logits of `tokens`; see [`models.Llama.forward`][] for the arguments."""
        return self.forward(tokens, key=key)[0]

    def forward(
        self, tokens: Int[Array, "batch seq"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "batch seq vocab"], Float[Array, ""]]:
        """Logits and auxiliary loss.

        **Arguments:**

        - `tokens`: integer token ids `(batch, seq)`, `seq <= config.max_seq_len`.
        - `key`: the step key. It is split into one key per layer, and each layer splits
          its key per projection, so no two projections share thresholds. Required when the
          policy is stochastic; may be `None` otherwise. (Keyword only argument.)

        **Returns:**

        `(logits, aux)`: float32 logits `(batch, seq, vocab)` and the scalar auxiliary loss,
        the mean over mixture-of-experts layers of `aux_loss_coef * load_balance +
        z_loss_coef * z_loss` (0.0 for a dense model).
        """
        c = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"Llama: `tokens` must be integer ids of shape (batch, seq), got "
                f"{tokens.dtype}{list(tokens.shape)}."
            )
        B, S = tokens.shape
        if S > c.max_seq_len:
            raise ValueError(f"Llama: sequence length {S} exceeds max_seq_len {c.max_seq_len}.")
        if key is None:
            stochastic = [p for p in _policies(self.layers) if p.stochastic]
            if stochastic:
                raise ValueError(
                    f"Llama: policy {stochastic[0]} rounds stochastically; pass a fresh "
                    "`key=` for every step (e.g. jax.random.fold_in(key, step))."
                )
        dtype = _dtype(c.compute_dtype)
        h = shard_batch(embed_tokens(self.embed, tokens).astype(dtype))
        cos, sin = _rope_tables(c, S)
        keys = None if key is None else jr.split(key, c.n_layers)
        aux = jnp.zeros((), _F32)
        start = 0
        for stack in self.layers:
            n = jtu.tree_leaves(stack)[0].shape[0]
            ks = None if keys is None else keys[start : start + n]
            h, layer_aux = _run_stack(stack, h, cos, sin, ks, c.remat)
            if isinstance(stack.mlp, MoE):
                aux = aux + jnp.mean(layer_aux)
            start += n
        h = self.norm(h)
        head = self.embed if self.head is None else self.head
        logits = jnp.einsum("bsd,vd->bsv", h, head.astype(dtype), preferred_element_type=_F32)
        return shard_batch(logits), aux


def _init_stack(abstract: DecoderLayer, key: PRNGKeyArray) -> DecoderLayer:
    """Fill an abstract layer stack with the initialisation of its modules, drawing all of it
    from ONE uniform tensor in one compiled program (compiling one random op per parameter
    costs seconds on a CPU).

    The rule is that of `QuantLinear` and `MoE`: norm weights (1-D per layer) are ones; a
    linear weight or router `(out, in)` is uniform in $\\pm 1/\\sqrt{in}$; an expert weight
    `(n_experts, in, out)` uniform in $\\pm 1/\\sqrt{in}$.
    """
    leaves, treedef = jtu.tree_flatten(abstract)

    def fill(key):
        u = jr.uniform(key, (sum(x.size for x in leaves),), _F32, -1.0, 1.0)
        out, start = [], 0
        for x in leaves:
            rank = x.ndim - 1  # without the layer axis
            if rank == 1:
                out.append(jnp.ones(x.shape, x.dtype))
            else:
                assert rank in (2, 3), x.shape
                fan_in = x.shape[-1] if rank == 2 else x.shape[-2]
                part = u[start : start + x.size].reshape(x.shape) / math.sqrt(fan_in)
                out.append(part.astype(x.dtype))
            start += x.size
        return out

    return jtu.tree_unflatten(treedef, jax.jit(fill)(key))


def _run_stack(stack: DecoderLayer, h, cos, sin, keys, remat: bool):
    dynamic, static = eqx.partition(stack, eqx.is_array)

    def body(carry, xs):
        layer_dynamic, k = xs
        layer = eqx.combine(layer_dynamic, static)
        return layer(carry, cos, sin, key=k)

    if remat:
        body = jax.checkpoint(body)
    return jax.lax.scan(body, h, (dynamic, keys))
