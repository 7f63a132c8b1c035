"""Perplexity and bits per byte of a model on a data config's validation sets.

The loss is the training run's evaluation, not a second implementation: Levanter's
`TaggedEvaluator` over `data.tagged_eval_sets`, with qkvflow's per-position loss
(`eval_losses`: `model.compute_next_token_loss(reduction=None)` in the compute
precision), the same eval batch size and the same `trainer.max_eval_batches` cap. So on the data,
grid and checkpoint a run evaluated, the loss is the run's `eval/loss`.

    loss       = sum_i w_i l_i / sum_i w_i           l_i = -log p(x_{i+1} | x_{<=i}), nats
    perplexity = exp(loss)
    bpb        = sum_i w_i l_i / (ln 2 * bytes)

`bytes` is the number of UTF-8 bytes of the evaluated target text: for every sequence, each run of
consecutive target positions (w_i > 0, target x_{i+1}) is decoded with the tokenizer
(`decode(ids, skip_special_tokens=True)`, so `<|endoftext|>` counts 0 bytes) and encoded as UTF-8.
A character split between two sequences by the packing is decoded as U+FFFD (3 bytes) on each side,
an error of a few bytes per sequence boundary.

Levanter's evaluator reports a bits per byte too (`levanter_bpb` here): there each token's byte length
is that of the token decoded alone (`levanter.utils.hf_utils.byte_length_of_token`), which miscounts
byte-level BPE tokens that hold part of a multi-byte character, and the ratio is taken per batch and
averaged with token weights, which equals the ratio of totals only when every batch has the same
bytes per token. `bpb` is the ratio of totals defined above.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from levanter.utils.tree_utils import inference_mode

from qkvflow.errors import UserError

LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Perplexity:
    loss: float
    """Mean next-token loss in nats over the weighted target positions."""
    tokens: float
    """Sum of the loss weights (the number of target tokens)."""
    bytes: int
    """UTF-8 bytes of the target text (see the module docstring)."""
    levanter_bpb: float | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def nats(self) -> float:
        return self.loss * self.tokens

    @property
    def bpb(self) -> float:
        return self.nats / (LN2 * self.bytes) if self.bytes else float("nan")

    def as_dict(self) -> dict:
        return {
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bpb": self.bpb,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "levanter_bpb": self.levanter_bpb,
        }


def eval_losses(mp):
    """The evaluator's per-position loss: the plain next-token loss of the model (a DiffEqFormer's
    kinetic penalty is a training regulariser, not part of the validation loss), in the compute
    precision, with the weights and target ids Levanter's evaluator aggregates per tag."""

    def per_position(model, batch):
        model = mp.cast_to_compute(inference_mode(model, True))
        loss = model.compute_next_token_loss(batch, reduction=None, reduction_axis=()).array
        return loss, batch.loss_weight.array, jnp.roll(batch.tokens.array, -1, axis=-1)

    return per_position


def make_evaluator(config, Pos, tokenizer):
    """Levanter's TaggedEvaluator over `config.data`'s validation sets, as `qkvflow train` builds it
    (qkvflow.training.loop.make_evaluator): same loss, batch axis, mesh, compute mapping and example cap."""
    import levanter.eval

    t = config.trainer
    eval_sets = config.data.tagged_eval_sets(Pos)
    if not eval_sets:
        raise UserError("data has no validation set: expected validation_urls (or a corpus) in the data config")
    max_examples = None if t.max_eval_batches is None else t.max_eval_batches * t.eval_batch_size
    return levanter.eval.TaggedEvaluator(
        t.EvalBatch, eval_sets, eval_losses(t.mp), tokenizer, t.device_mesh, t.compute_axis_mapping, max_examples
    )


def target_bytes(tokens: np.ndarray, weights: np.ndarray, tokenizer) -> int:
    """UTF-8 bytes of the target text of a batch: `tokens` [batch, pos], `weights` [batch, pos] the
    loss weight of predicting tokens[:, i + 1] at position i. Each run of consecutive weighted
    positions of a row is decoded as one piece of text."""
    targets = np.roll(tokens, -1, axis=-1)
    total = 0
    for row, w in zip(targets, weights):
        on = np.concatenate([[False], w > 0, [False]])
        starts = np.flatnonzero(on[1:] & ~on[:-1])
        ends = np.flatnonzero(~on[1:] & on[:-1])
        for a, b in zip(starts, ends):
            text = tokenizer.decode(row[a:b].tolist(), skip_special_tokens=True)
            total += len(text.encode("utf-8"))
    return total


def count_targets(evaluator, tokenizer) -> tuple[float, int]:
    """(sum of loss weights, target bytes) of every batch the evaluator scores: its own data loader,
    read again on the host."""
    tokens_total, bytes_total = 0.0, 0
    for batch, _tags in evaluator.loader:
        tokens = np.asarray(batch.tokens.array)
        weights = np.asarray(batch.loss_weight.array)
        tokens_total += float(weights.sum())
        bytes_total += target_bytes(tokens, weights, tokenizer)
    return tokens_total, bytes_total


def evaluate(evaluator, model, counts: tuple[float, int]) -> Perplexity:
    """Score `model` with `evaluator`; `counts` from `count_targets` (the same for every model scored
    on these batches)."""
    import levanter.eval

    log = levanter.eval.eval_model(evaluator, model, prefix="eval")
    tokens, nbytes = counts
    return Perplexity(loss=float(log["eval/loss"]), tokens=tokens, bytes=nbytes, levanter_bpb=log.get("eval/bpb"))
