"""The mixture-of-experts FFN: a float top-k router and INT8 ragged expert GEMMs."""

import math
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from s3req import AbstractPolicy, qragged_dot, ShardAxes

from ._config import MoEConfig
from ._ffn import FFN
from ._sharding import batch_axes, tensor_axis


_F32 = jnp.float32


def _uniform(key, shape, fan_in):
    lim = 1 / math.sqrt(fan_in)
    return jr.uniform(key, shape, _F32, -lim, lim)


def sort_by_expert(
    experts: Int[Array, "tokens top_k"], n_experts: int
) -> tuple[Int[Array, " pairs"], Int[Array, " n_experts"]]:
    """Sort the `(token, slot)` pairs of a routing by expert; drop nothing.

    **Arguments:**

    - `experts`: the chosen experts of every token, `(tokens, top_k)`.
    - `n_experts`: number of experts.

    **Returns:**

    `(order, group_sizes)`: `order[r]` is the pair id `token * top_k + slot` of sorted row `r`
    (a permutation of `range(tokens * top_k)`, stable, so each expert's rows stay in token
    order), and `group_sizes[e]` the number of rows of expert `e` (summing to
    `tokens * top_k`).
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return order, group_sizes


@typing.final
class MoE(eqx.Module):
    """A mixture-of-experts SwiGLU FFN (Qwen3-MoE / DeepSeek-MoE style) that drops no token.

    A float router $z = x W_r^\\top$ gives softmax probabilities $p = \\mathrm{softmax}(z)$;
    each token goes to its `top_k` most probable experts with weights $p_{t,e}$ (renormalised
    over the chosen experts when `norm_topk_prob`). The `(token, slot)` pairs are sorted by
    expert and every expert's SwiGLU runs as three INT8 ragged GEMMs
    (`s3req.qragged_dot`, int32 accumulation, thresholds keyed by the global
    `(token, slot)` id, error correction over `(example, expert)` segments). Shared experts,
    if any, are one [`models.FFN`][] of width `n_shared_experts * d_expert` that sees every
    token.

    Auxiliary loss (per layer): $\\alpha\\, E \\sum_e f_e P_e + \\beta\\,
    \\operatorname{mean}_t (\\log\\sum_e e^{z_{t,e}})^2$, with $f_e$ the fraction of the
    $T$ tokens routed to expert $e$ (any slot; $\\sum_e f_e = k$), $P_e$ the mean router
    probability of $e$, $\\alpha$ = `aux_loss_coef`, $\\beta$ = `z_loss_coef` (the
    load-balancing term is Hugging Face's Mixtral / Qwen3-MoE formula for one layer).

    **Arguments:**

    - `d_model`: input and output width.
    - `config`: a [`models.MoEConfig`][].
    - `policy`: the rounding policy of the expert GEMMs and the shared experts, or `None`.
    - `key`: initialisation key. (Keyword only argument.)
    """

    router: Float[Array, "n_experts d_model"]
    w_gate: Float[Array, "n_experts d_model d_expert"]
    w_up: Float[Array, "n_experts d_model d_expert"]
    w_down: Float[Array, "n_experts d_expert d_model"]
    shared: FFN | None
    policy: AbstractPolicy | None
    config: MoEConfig = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        config: MoEConfig,
        policy: AbstractPolicy | None,
        *,
        key: PRNGKeyArray,
    ):
        E, F = config.n_experts, config.d_expert
        kr, kg, ku, kd, ks = jr.split(key, 5)
        self.router = _uniform(kr, (E, d_model), d_model)
        self.w_gate = _uniform(kg, (E, d_model, F), d_model)
        self.w_up = _uniform(ku, (E, d_model, F), d_model)
        self.w_down = _uniform(kd, (E, F, d_model), F)
        n_shared = config.n_shared_experts
        self.shared = FFN(d_model, n_shared * F, policy, key=ks) if n_shared else None
        self.policy = policy
        self.config = config

    def __check_init__(self):
        if self.policy is not None and not isinstance(self.policy, AbstractPolicy):
            raise TypeError(f"MoE: `policy` must be a Policy or None, got {self.policy!r}.")

    def route(
        self, x: Float[Array, "tokens d_model"]
    ) -> tuple[
        Float[Array, "tokens top_k"],
        Int[Array, "tokens top_k"],
        Float[Array, "tokens n_experts"],
    ]:
        """The routing of tokens `x`: `(weights, experts, logits)`.

        `experts[t]` are the `top_k` chosen experts of token `t` (most probable first),
        `weights[t]` their combination weights (float32) and `logits` the float32 router
        logits.
        """
        logits = jnp.dot(x, self.router.astype(x.dtype).T, preferred_element_type=_F32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.config.top_k)
        if self.config.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts.astype(jnp.int32), logits

    def aux_loss(
        self, experts: Int[Array, "tokens top_k"], logits: Float[Array, "tokens n_experts"]
    ) -> Float[Array, ""]:
        """The weighted load-balancing loss plus router z-loss of one routing."""
        return self._aux(*self._aux_sums(experts, logits), experts.shape[0])

    def _aux_sums(self, experts, logits) -> tuple[Array, Array, Array]:
        """The sums the auxiliary loss is made of: per-expert routed counts, per-expert
        router probabilities summed over tokens, and the summed squared log-partitions."""
        counts = jnp.bincount(experts.reshape(-1), length=self.config.n_experts).astype(_F32)
        prob_sum = jnp.sum(jax.nn.softmax(logits, axis=-1), axis=0)
        z_sum = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return counts, prob_sum, z_sum

    def _aux(self, counts, prob_sum, z_sum, tokens: int) -> Array:
        c = self.config
        frac = counts / tokens  # f_e: fraction of tokens sent to e (sums to top_k)
        mean_prob = prob_sum / tokens  # P_e
        balance = c.n_experts * jnp.sum(frac * mean_prob)
        return c.aux_loss_coef * balance + c.z_loss_coef * (z_sum / tokens)

    def __call__(
        self, x: Float[Array, "batch seq d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "batch seq d_model"]:
        """The block's output; see [`models.MoE.forward`][]."""
        return self.forward(x, key=key)[0]

    def forward(
        self, x: Float[Array, "batch seq d_model"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "batch seq d_model"], Float[Array, ""]]:
        """Route, run the experts, combine.

        **Arguments:**

        - `x`: activations `(batch, seq, d_model)`.
        - `key`: a fresh key, split per expert GEMM and for the shared experts; required when
          the policy is stochastic. (Keyword only argument.)

        **Returns:**

        `(y, aux)`: the output in the dtype of `x` and the weighted auxiliary loss.
        """
        B = x.shape[0]
        keys = [None] * 4 if key is None else list(jr.split(key, 4))
        axes = batch_axes(B)
        if axes:
            y, aux = self._routed_per_shard(x, keys[:3], axes)
        else:
            y, sums = self._routed(x, keys[:3], 0, B, (ShardAxes(), ShardAxes()))
            aux = self._aux(*sums, B * x.shape[1])
        if self.shared is not None:
            y = y + self.shared(x, key=keys[3])
        return y, aux

    def _routed(
        self, x, keys, first: Array | int, num_examples: int, axes: tuple[ShardAxes, ShardAxes]
    ):
        """The routed experts on the examples `first, first + 1, ...` of a batch of
        `num_examples` (all of them, or one shard's inside `shard_map`, where `axes` are the
        `ShardAxes` of the gate/up and of the down GEMMs): their output and the sums of
        their auxiliary loss."""
        B, S, D = x.shape
        c = self.config
        T, k, E = B * S, c.top_k, c.n_experts
        xf = x.reshape(T, D)
        weights, experts, logits = self.route(xf)
        # Sort the (token, slot) pairs by expert; pair id = token * top_k + slot, made
        # global by the offset of the first example.
        order, group_sizes = sort_by_expert(experts, E)
        token = order // k
        example = first + token // S
        row_id = first * (S * k) + order
        xs = xf[token]

        def qr(h, w, key, axes):
            return qragged_dot(
                h,
                w,
                group_sizes,
                policy=self.policy,
                key=key,
                row_id=row_id,
                example_id=example,
                num_examples=num_examples,
                axes=axes,
            )

        column, row = axes
        h = jax.nn.silu(qr(xs, self.w_gate, keys[0], column)) * qr(xs, self.w_up, keys[1], column)
        ys = qr(h, self.w_down, keys[2], row)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=jnp.int32))
        y = jnp.einsum("tkd,tk->td", ys[inverse].reshape(T, k, D), weights.astype(x.dtype))
        return y.reshape(B, S, D), self._aux_sums(experts, logits)

    def _routed_per_shard(self, x, keys, axes: tuple[str, ...]):
        """`_routed` inside `jax.shard_map` over the ambient mesh, every shard routing and
        sorting its own tokens (no gather of the batch over `axes`). The expert weights are
        gathered over the batch axes (FSDP) and split over `tp` when it divides `d_expert`
        (gate and up column-parallel, down row-parallel, as the dense FFN). The thresholds
        see the global `(token, slot)` ids and the error correction the global
        `(example, expert)` segments (`ShardAxes`), so the maths is that of the unsharded
        block; the auxiliary loss sums over every shard."""
        B, S, _ = x.shape
        mesh = jax.sharding.get_abstract_mesh()
        tp = tensor_axis(self.config.d_expert)
        column, row = ShardAxes(batch=axes, d_out=tp), ShardAxes(batch=axes, d_in=tp)
        local = B // math.prod(mesh.shape[a] for a in axes)
        params = (self.router, self.w_gate, self.w_up, self.w_down)

        def body(x, params, keys):
            moe = eqx.tree_at(lambda m: (m.router, m.w_gate, m.w_up, m.w_down), self, params)
            first = column.index("batch") * local
            y, sums = moe._routed(x, keys, first, B, (column, row))
            sums = tuple(jax.lax.psum(v, axes) for v in sums)
            return y, moe._aux(*sums, B * S)

        batch = P(axes)
        specs = (P(), P(None, None, tp), P(None, None, tp), P(None, tp, None))
        return jax.shard_map(
            body, mesh=mesh, in_specs=(batch, specs, P()), out_specs=(batch, P())
        )(x, params, keys)
