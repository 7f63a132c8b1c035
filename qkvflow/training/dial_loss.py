"""The depth-dial recipes' part of a DiffEqFormer's training loss (`qkvflow.models.depth_dial`).

`dial_flow` replaces the model's `flow` in `qkvflow.training.loss.lm_loss` when a recipe is on and the
loss has Levanter's training key: it returns x(T) of the drawn solve (whose next-token loss is the
loss), the kinetic energy, the solver statistics, the recipes' added loss

    consistency_weight * KL(p_fine || p_coarse) + jacobian_weight * int ||dF/dx||_F^2 dt / tokens

and their metrics (`train/dial_*`).
"""

import haliax as hax
import jax.numpy as jnp
from levanter.metrics import Metric, ReductionType

from qkvflow.models.depth_dial import drawn_solves


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
