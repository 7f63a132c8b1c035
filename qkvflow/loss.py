"""The training loss: Levanter's next-token cross-entropy, plus what an ODE model adds.

For a DiffEqFormer the loss also carries the kinetic penalty lambda/2 * E (when lambda > 0) and
returns the solver's statistics as metrics, which Levanter's trainer logs as `train/ode_*`.
Other models (Levanter's GPT-2/Llama baselines) go through `compute_next_token_loss` unchanged.
"""

import jax.numpy as jnp
from levanter.metrics import Metric, ReductionType
from levanter.models.lm_model import LmExample, LmHeadModel, compute_next_token_loss
from levanter.models.loss import maybe_fused_next_token_loss

from qkvflow.models.lm import DiffEqFormerLMHeadModel


def lm_loss(model: LmHeadModel, example: LmExample, *, key=None, z_loss_weight: float = 0.0):
    if not isinstance(model, DiffEqFormerLMHeadModel):
        return compute_next_token_loss(model, example, key=key, logsumexp_weight=z_loss_weight)

    x, energy, stats = model.flow(example.tokens, example.attn_mask)
    loss = maybe_fused_next_token_loss(
        model.Pos,
        model.Embed,
        model.Vocab,
        model.final_norm(x),
        model.get_lm_head(),
        example.tokens,
        loss_mask=example.loss_mask,
        logsumexp_weight=z_loss_weight,
        dtype=jnp.float32,
        block_size=model.config.cross_entropy_block_size,
    )
    metrics = {
        "ode_nfe": Metric.from_value(stats.nfe.astype(jnp.float32), ReductionType.MEAN),
        "ode_steps": Metric.from_value(stats.num_steps.astype(jnp.float32), ReductionType.MEAN),
    }
    if energy is not None:
        metrics["ode_kinetic_energy"] = Metric.from_value(energy, ReductionType.MEAN)
        loss = loss + 0.5 * model.config.kinetic_weight * energy
    return loss, metrics
