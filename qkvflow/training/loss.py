"""The training loss: Levanter's next-token cross-entropy, plus what an ODE model adds.

For a DiffEqFormer and an N-ODE Transformer (`node_transformer`) the loss also carries the kinetic
penalty lambda/2 * E (when lambda > 0) and returns the solver's statistics as metrics, which Levanter's
trainer logs as `train/ode_*`. Both give `flow(tokens, mask) -> (x, E, OdeStats)`; the DiffEqFormer's x
still goes through its final norm, the N-ODE's is already the readout's hidden layer. With a
DiffEqFormer's `exits: aligned` the loss is the mean over the N grid-time exits
(`qkvflow.models.related.ode_exits`), each exit's loss logged as `train/ode_exit_loss_k`.
With a DiffEqFormer's `dial` recipes on, a training step (one given a key) solves on the grid they draw
and adds their terms (the last section below); evaluation solves on the config's grid.
Other models (Levanter's GPT-2/Llama baselines) go through their own `compute_next_token_loss`.

The depth-dial recipes' part (`qkvflow.models.depth_dial`): `dial_flow` replaces the model's `flow` in
`lm_loss` when a recipe is on and the
loss has Levanter's training key: it returns x(T) of the drawn solve (whose next-token loss is the
loss), the kinetic energy, the solver statistics, the recipes' added loss

    consistency_weight * KL(p_fine || p_coarse) + jacobian_weight * int ||dF/dx||_F^2 dt / tokens

and their metrics (`train/dial_*`).
"""

import functools

import haliax as hax
import jax.numpy as jnp
from levanter.metrics import Metric, ReductionType
from levanter.models.lm_model import LmExample, LmHeadModel
from levanter.models.loss import maybe_fused_next_token_loss

from qkvflow.errors import UserError
from qkvflow.models.depth_dial import drawn_solves
from qkvflow.models.diffeqformer import DiffEqFormerLMHeadModel
from qkvflow.models.related.node_lm import NodeTransformerLMHeadModel
from qkvflow.models.related.ode_exits import aligned_loss


def lm_loss(model: LmHeadModel, example: LmExample, *, key=None, z_loss_weight: float = 0.0, vocab_block=None):
    """Mean next-token cross-entropy over `example.loss_weight` (+ z-loss, + the kinetic penalty).

    Levanter computes the loss in the dtype of the weights it is given; an integer weight would give
    an integer (wrong) loss, so the weight is made float32 here. `vocab_block` (`loss_vocab_block`) sets
    the vocabulary block of Levanter's cross-entropy for every model alike; None keeps each model's own
    (a DiffEqFormer's `cross_entropy_block_size`, Levanter's streaming for the others).
    """
    weight = example.loss_weight
    if weight is not None and not jnp.issubdtype(weight.dtype, jnp.floating):
        weight = weight.astype(jnp.float32)
    metrics = {}
    if isinstance(model, DiffEqFormerLMHeadModel) and model.config.exits == "aligned":
        loss, per_exit, energy, stats = aligned_loss(
            model, example.tokens, example.attn_mask, weight, z_loss_weight=z_loss_weight, block_size=vocab_block
        )
        for k, exit_loss in enumerate(per_exit, start=1):
            metrics[f"ode_exit_loss_{k}"] = Metric.from_value(exit_loss, ReductionType.MEAN)
        return _with_ode_terms(model, loss, energy, stats, metrics)
    added = None
    if isinstance(model, DiffEqFormerLMHeadModel) and key is not None and model.config.dial.active:
        x, energy, stats, added, dial_metrics = dial_flow(model, example, weight, key)  # training only
        metrics.update(dial_metrics)
        x = model.final_norm(x)
    elif isinstance(model, DiffEqFormerLMHeadModel):
        x, energy, stats = model.flow(example.tokens, example.attn_mask, key=key)  # a key: dropout (training)
        x = model.final_norm(x)
    elif isinstance(model, NodeTransformerLMHeadModel):
        x, energy, stats = model.flow(example.tokens, example.attn_mask)
    else:
        if weight is not example.loss_weight:
            example = LmExample(tokens=example.tokens, loss_weight=weight, attn_mask=example.attn_mask)
        if vocab_block is None:
            return model.compute_next_token_loss(example, key=key, logsumexp_weight=z_loss_weight)
        check_vocab_block(type(model), vocab_block)
        return levanter_loss_in_blocks(model, example, vocab_block, key=key, z_loss_weight=z_loss_weight)

    loss = maybe_fused_next_token_loss(
        model.Pos,
        model.Embed,
        model.Vocab,
        x,
        model.get_lm_head(),
        example.tokens,
        loss_weight=weight,
        logsumexp_weight=z_loss_weight,
        dtype=jnp.float32,
        block_size=vocab_block if vocab_block is not None else getattr(model.config, "cross_entropy_block_size", None),
    )
    if added is not None:
        loss = loss + added
    return _with_ode_terms(model, loss, energy, stats, metrics)


def check_vocab_block(model_type, vocab_block) -> None:
    """`loss_vocab_block` reaches the loss of the ODE models (computed in `lm_loss`) and of models whose loss
    is Levanter's own `compute_next_token_loss`; a model that overrides that method (the related designs'
    exit and halting losses) is refused in one line rather than trained on a loss it would bypass."""
    ours = issubclass(model_type, (DiffEqFormerLMHeadModel, NodeTransformerLMHeadModel))
    if vocab_block is None or ours or model_type.compute_next_token_loss is LmHeadModel.compute_next_token_loss:
        return
    raise UserError(
        f"loss_vocab_block={vocab_block} does not reach {model_type.__name__}'s loss, which is its own "
        "(compute_next_token_loss); leave loss_vocab_block null for this model"
    )


def levanter_loss_in_blocks(model: LmHeadModel, example: LmExample, block_size: int, *, key=None, z_loss_weight=0.0):
    """Levanter's `LmHeadModel.compute_next_token_loss(example)` with the cross-entropy's vocabulary block
    set, which that method does not take: its own body (the activations, then `maybe_fused_next_token_loss`
    in float32). `tests/test_vocab_block.py` pins it to Levanter's method."""
    activations = model.activations(example.tokens, example.attn_mask, key=key)
    aux = 0
    if isinstance(activations, tuple):
        activations, aux = activations
    loss = maybe_fused_next_token_loss(
        model.Pos,
        model.Embed,
        model.Vocab,
        activations,
        model.get_lm_head(),
        example.tokens,
        loss_weight=example.loss_weight,
        logsumexp_weight=z_loss_weight,
        dtype=jnp.float32,
        block_size=block_size,
    )
    return loss + aux


def train_loss(config):
    """The loss `qkvflow train` trains `config` with (its `z_loss_weight` and `loss_vocab_block` bound)."""
    return functools.partial(lm_loss, z_loss_weight=config.z_loss_weight, vocab_block=config.loss_vocab_block)


def _with_ode_terms(model, loss, energy, stats, metrics: dict):
    """The solver's metrics, and the kinetic penalty when lambda > 0."""
    metrics["ode_nfe"] = Metric.from_value(stats.nfe.astype(jnp.float32), ReductionType.MEAN)
    metrics["ode_steps"] = Metric.from_value(stats.num_steps.astype(jnp.float32), ReductionType.MEAN)
    if energy is not None and model.config.kinetic_weight > 0:
        metrics["ode_kinetic_energy"] = Metric.from_value(energy, ReductionType.MEAN)
        loss = loss + 0.5 * model.config.kinetic_weight * energy
    return loss, metrics


# --- the depth dial's recipes ----------------------------------------------------------------------------


def consistency_kl(logits_coarse: jnp.ndarray, logits_fine: jnp.ndarray, weight=None) -> jnp.ndarray:
    """Weighted mean over positions of KL(p_fine || p_coarse) = sum_v p_fine (log p_fine - log p_coarse),
    p = softmax over the last axis (computed in float32); `weight` (the positions' loss weights, shaped
    like the logits less their last axis) None: every position counts alike."""
    log_c = _log_softmax(logits_coarse)
    log_f = _log_softmax(logits_fine)
    kl = jnp.sum(jnp.exp(log_f) * (log_f - log_c), axis=-1)
    if weight is None:
        return jnp.mean(kl)
    weight = jnp.asarray(weight, jnp.float32)
    return jnp.sum(weight * kl) / jnp.maximum(jnp.sum(weight), 1e-9)


def _log_softmax(logits):
    logits = logits.astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def dial_flow(model, example, weight, key):
    """(x(T) as a NamedArray before the final norm, energy or None, OdeStats, added loss, metrics)."""
    dial = model.config.dial
    x, fine, energy, frobenius, stats, count = drawn_solves(model, example.tokens, example.attn_mask, key)
    axes = (*example.tokens.axes, model.Embed)
    x = hax.named(x, axes)
    added = jnp.zeros((), jnp.float32)
    metrics = {"dial_steps": Metric.from_value(count.astype(jnp.float32), ReductionType.MEAN)}
    if fine is not None:
        head = model.get_lm_head()
        coarse_logits = hax.dot(model.final_norm(x), head, axis=model.Embed)
        fine_logits = hax.dot(model.final_norm(hax.named(fine, axes)), head, axis=model.Embed)
        order = (*example.tokens.axes, model.Vocab)
        w = None if weight is None else weight.rearrange(example.tokens.axes).array
        kl = consistency_kl(coarse_logits.rearrange(order).array, fine_logits.rearrange(order).array, w)
        metrics["dial_consistency_kl"] = Metric.from_value(kl, ReductionType.MEAN)
        added = added + dial.consistency_weight * kl
    if frobenius is not None:
        metrics["dial_jacobian_frobenius"] = Metric.from_value(frobenius, ReductionType.MEAN)
        added = added + dial.jacobian_weight * frobenius
    return x, energy, stats, added, metrics
