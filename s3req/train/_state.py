"""The train state, the optimizer and the training step that `train` and the experiments share."""

import typing
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ._config import TrainConfig


@typing.final
class TrainState(eqx.Module):
    """What one training step reads and replaces: the model, the optimizer state and the count
    of updates applied.

    **Arguments:**

    - `model`: the model (e.g. a `models.Llama`).
    - `opt_state`: the optax state of the optimizer, for the inexact-array leaves of `model`.
    - `step`: the number of updates applied so far (an `int32` scalar).
    """

    model: typing.Any
    opt_state: PyTree
    step: Int[Array, ""]


def init_state(model: typing.Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A [`s3req.train.TrainState`][] at step 0 for `model`.

    The optimizer state is built from the model's inexact arrays, so its moments sit on the
    parameters' shardings.

    **Arguments:**

    - `model`: the model.
    - `optimizer`: the optax optimizer.

    **Returns:**

    The state.
    """
    # optax mixes Python floats with int32 step counts: allow standard promotion here even
    # when the caller runs JAX with jax_numpy_dtype_promotion="strict".
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    return TrainState(model, opt_state, jnp.zeros((), jnp.int32))


def make_optimizer(
    config: TrainConfig,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup, cosine decay and global-norm clipping.

    Weight decay applies to parameters with two or more axes (not to norms or biases).

    **Returns:**

    `(optimizer, learning-rate schedule)`.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=config.warmup,
        decay_steps=max(config.steps, config.warmup + 1),
        end_value=config.lr * config.min_lr_ratio,
    )

    def decay_mask(params):
        return jtu.tree_map(lambda p: p.ndim >= 2, params)

    adamw = optax.adamw(
        schedule,
        b1=config.beta1,
        b2=config.beta2,
        weight_decay=config.weight_decay,
        mask=decay_mask,
    )
    if config.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw), schedule
    return adamw, schedule


def next_token_loss(
    model: typing.Any, tokens: Int[Array, "batch seq1"], key: PRNGKeyArray
) -> tuple[Float[Array, ""], tuple[Float[Array, ""], Float[Array, ""]]]:
    """Mean next-token cross-entropy plus the model's auxiliary loss.

    **Arguments:**

    - `model`: a model whose `forward(tokens, key=...)` returns `(logits, aux_loss)`.
    - `tokens`: `(batch, seq + 1)` windows: inputs and the targets shifted by one.
    - `key`: the step key (thresholds of the stochastic rounding).

    **Returns:**

    `(cross-entropy + aux, (cross-entropy, aux))`, the form `eqx.filter_value_and_grad(...,
    has_aux=True)` takes.
    """
    logits, aux = model.forward(tokens[:, :-1], key=key)
    logits = logits.astype(jnp.float32)
    aux = jnp.asarray(aux, jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + aux, (ce, aux)


def _apply(model, updates, key):
    del key
    return eqx.apply_updates(model, updates)


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    loss: Callable[..., typing.Any] = next_token_loss,
    prepare: Callable[[typing.Any], typing.Any] | None = None,
    apply_updates: Callable[[typing.Any, PyTree, typing.Any], typing.Any] | None = None,
    extra_metrics: Callable[[typing.Any, typing.Any, PyTree], dict[str, Array]] | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """The jitted training step: forward, (quantized) backward, optimizer, update.

    `step(state, tokens, key, update_key=None) -> (new_state, metrics)`, where `metrics` holds
    the scalars `loss` (cross-entropy), `aux_loss` and `grad_norm` (global norm of the
    gradients before clipping, `optax.tree.norm`, which replaces the deprecated
    `optax.global_norm`). `key` is the step key of the model's
    stochastic rounding (the loop passes `fold_in(train_key, step)`); `update_key` goes to
    `apply_updates`.

    **Arguments:**

    - `optimizer`: the optax optimizer (e.g. from [`s3req.train.make_optimizer`][]).
    - `loss`: `loss(model, tokens, key) -> (total, (cross-entropy, aux))`; default
      [`s3req.train.next_token_loss`][].
    - `prepare`: maps the stored model to the model the loss differentiates (e.g. a float32
      upcast of bfloat16 weights); the updates are computed for the prepared parameters.
      Default: the stored model itself.
    - `apply_updates`: `apply_updates(model, updates, update_key) -> model` (e.g. stochastic
      rounding into bfloat16); default `eqx.apply_updates`.
    - `extra_metrics`: `extra_metrics(old_model, new_model, updates) -> dict of scalars`,
      merged into `metrics`.
    - `mesh`: the device mesh of a sharded step (e.g. from [`s3req.train.make_mesh`][]), or
      `None`. The step is traced under it (`jax.sharding.use_abstract_mesh`), so the
      models keep their activations split over the mesh's batch axes (`fsdp`, `data`) and
      each data shard routes its own tokens through the MoE experts (see the scaling guide).
      A step called inside `with jax.set_mesh(mesh):` gets the same without it.
      (Keyword only argument.)

    **Returns:**

    The step function (an `eqx.filter_jit`).
    """
    apply = _apply if apply_updates is None else apply_updates

    @eqx.filter_jit
    def step(state: TrainState, tokens, key, update_key=None):
        if mesh is None:
            return _step(state, tokens, key, update_key)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return _step(state, tokens, key, update_key)

    def _step(state: TrainState, tokens, key, update_key):
        model = state.model
        work = model if prepare is None else prepare(model)
        grad_fn = eqx.filter_value_and_grad(loss, has_aux=True)
        (_, (ce, aux)), grads = grad_fn(work, tokens, key)
        params = eqx.filter(work, eqx.is_inexact_array)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, state.opt_state, params)
            grad_norm = optax.tree.norm(grads)
        new_model = apply(model, updates, update_key)
        metrics = {"loss": ce, "aux_loss": aux, "grad_norm": grad_norm}
        if extra_metrics is not None:
            metrics.update(extra_metrics(model, new_model, updates))
        return TrainState(new_model, opt_state, state.step + 1), metrics

    return step
