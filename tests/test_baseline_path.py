"""The GPT-2 baseline trains in `qkvflow train` as in Levanter's own `train_lm`.

Every comparison in docs/results.md pairs a DiffEqFormer with Levanter's GPT-2 (and Llama) trained by
`qkvflow train`, which hands Levanter's `Trainer` its own pieces (`loop.make_trainer`): the loss
(`loss.train_loss`: `lm_loss`, and `levanter_loss_in_blocks` when `loss_vocab_block` is set), the
weight-decay mask (`weight_decay.with_decay_mask`), the first-moment dtype of the hypernetwork
projections (`adam.with_hypernetwork_mu_dtype`, bfloat16 by default since d7d9628) and the
non-finite guard (`faults.guard_nonfinite`). For a model without hypernetworks the first three must leave
the step exactly as Levanter's `train_lm` builds it (levanter/main/train_lm.py: the optimizer
`config.optimizer.build(num_train_steps)`, the loss `model.compute_next_token_loss(example, key=key,
logsumexp_weight=z_loss_weight)`), so that a study's baseline cannot move when qkvflow's options for its
own models change.

Reference: that `train_lm` step, built here from Levanter's parts, with qkvflow's non-finite guard around
its optimizer. Both trainers take the same model and batches for a few steps with the studies' optimizer
(cosine schedule with warmup, weight decay 0.1, beta2 0.99, clipping; a larger peak rate, so that a few
steps learn): per-step losses and final parameters must be equal bit for bit. The guard itself changes no value of a finite step, but its select
makes XLA compile the update differently: without it the parameters differ by float32 round-off (most
in the near-zero biases, where Adam divides by a small second moment), and the losses agree to round-off.
"""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.random as jrandom
import jmp
import numpy as np
from levanter.models.gpt2 import Gpt2Config
from levanter.models.lm_model import LmExample
from levanter.optim import AdamConfig
from levanter.tracker.tracker import NoopConfig
from levanter.trainer import Trainer, TrainerConfig

from qkvflow.runs.config import TrainConfig
from qkvflow.training import faults, loop
from qkvflow.training.loss import train_loss
from tests.helpers import Vocab

STEPS = 8
Batch = hax.Axis("batch", 4)


def _config(tmp_path, **overrides) -> TrainConfig:
    trainer = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=Batch.size,
        mp=jmp.get_policy("p=f32,c=f32"),
        tracker=NoopConfig(),
        require_accelerator=False,
        seed=0,
        id="baseline",
        log_dir=tmp_path / "logs",
        log_jaxprs=False,
        log_xla_hlo=False,
    )
    trainer = dataclasses.replace(
        trainer, checkpointer=dataclasses.replace(trainer.checkpointer, base_path=str(tmp_path / "ckpt"))
    )
    optimizer = AdamConfig(
        learning_rate=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.99, warmup=0.125, min_lr_ratio=0.1,
        lr_schedule="cosine", max_grad_norm=1.0,
    )  # fmt: skip
    model = Gpt2Config(max_seq_len=16, hidden_dim=32, num_heads=4, num_layers=2)
    return dataclasses.replace(TrainConfig(trainer=trainer, model=model, optimizer=optimizer), **overrides)


def _batches(config):
    """Sequences that count up by 5 from a random start (mod the vocabulary): learnable in a few steps."""
    Pos = config.model.max_Pos
    starts = [hax.random.randint(k, (Batch,), 0, Vocab.size) for k in jrandom.split(jrandom.PRNGKey(7), STEPS)]
    tokens = [(start.broadcast_axis(Pos) + 5 * hax.arange(Pos)) % Vocab.size for start in starts]
    return [hax.vmap(LmExample.causal, Batch)(t) for t in tokens]


def _train(trainer: Trainer, config) -> tuple[list, list]:
    """Per-step losses and the final parameters of `trainer` from the same model and batches."""
    losses = []
    with trainer:
        model = config.model.build(Vocab, key=jrandom.PRNGKey(0))
        state = trainer.initial_state(jrandom.PRNGKey(1), model=model)
        for info in trainer.training_steps(state, _batches(config)):
            losses.append(np.float32(info.loss))
            state = info.state
    params = jax.tree_util.tree_leaves(eqx.filter(state.model, eqx.is_inexact_array))
    return losses, [np.asarray(p) for p in params]


def _levanter_train_lm(config, guard: bool) -> Trainer:
    """The trainer levanter/main/train_lm.py builds for `config` (with `guard`: its optimizer in qkvflow's
    non-finite guard)."""
    optimizer = config.optimizer.build(config.trainer.num_train_steps)
    optimizer = faults.guard_nonfinite(optimizer) if guard else optimizer

    def loss_function(model, example, *, key=None):
        return model.compute_next_token_loss(example, key=key, logsumexp_weight=config.z_loss_weight)

    return Trainer(config.trainer, optimizer, loss_function, add_default_hooks=False)


def test_gpt2_trains_as_in_levanters_train_lm_bit_for_bit(tmp_path):
    config = _config(tmp_path)
    assert config.hypernetwork_mu_dtype == "auto" and config.loss_vocab_block is None  # a new run's defaults
    ours, _ = loop.make_trainer(config, train_loss(config))
    got_losses, got_params = _train(ours, config)
    want_losses, want_params = _train(_levanter_train_lm(config, guard=True), config)
    assert len(got_losses) == STEPS and want_losses[-1] < want_losses[0] - 0.05  # the steps really trained
    assert got_losses == want_losses
    assert len(got_params) == len(want_params)
    for got, want in zip(got_params, want_params):
        np.testing.assert_array_equal(got, want)

    unguarded_losses, _ = _train(_levanter_train_lm(config, guard=False), config)
    np.testing.assert_allclose(got_losses, unguarded_losses, rtol=1e-6)  # float32 round-off of a loss near 4
