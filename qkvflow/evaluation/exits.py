"""Exits at evaluation: exit rules, per-exit and per-rule scores, and the FLOPs of an exit pattern
(Elbayad et al., "Depth-Adaptive Transformer", ICLR 2020; the model: `qkvflow.models.related.adaptive`).

Scores are over the weighted target tokens (Levanter's next-token weighting: `loss_weight`, never the
last position), summed over batches and divided at the end:

    loss      = sum_t w_t (-log p_{e_t}(y_{t+1})) / sum_t w_t        e_t: token t's exit (1..N)
    accuracy  = sum_t w_t [argmax p_{e_t} = y_{t+1}] / sum_t w_t
    avg exit  = sum_t w_t e_t / sum_t w_t

FLOPs per token (forward, multiply-adds counted as 2), for a model of N blocks, hidden d, vocabulary V:

    F(e) = e * F_layer + (N - e) * F_copy + C(e)
    F_layer   one block for one token (Levanter's `lm_flops_per_token` with one layer and no head:
              projections, feed-forward, and the token's share of a full attention map of the context)
    F_copy    = 4 d^2: the keys and values that a block above a token's exit still computes from its
              copied state, for later tokens to attend to
    C(e)      the classifiers the exit decision reads:
                confidence threshold   C(e) = e * 2 V d             (the full classifier at every exit
                                                                     passed; the one at e gives the output)
                halting head           C(e) = min(e, N - 1) * 2 d + 2 V d
                                                                    (a d -> 1 test at every exit before
                                                                     the last, one classifier at the exit)
                fixed exit (truncation to e blocks): e * F_layer + 2 V d, no copies, no tests

The average over tokens is weighted as the scores are. Embedding look-ups are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray


def confidence_threshold(tau) -> Callable:
    """The rule "exit at the first n with max_v p_n(v) > tau" (`qkvflow.models.related.adaptive.ExitRule`)."""

    def rule(n: int, x: NamedArray, logits: NamedArray) -> NamedArray:
        Vocab = logits.resolve_axis("vocab")
        return hax.max(hax.nn.softmax(logits, Vocab), Vocab) > tau

    return rule


def fixed_exit(n_exit: int) -> Callable:
    """Every token exits at `n_exit` (the truncation to n_exit blocks)."""
    return lambda n, x, logits: hax.full(logits.axes[:-1], n >= n_exit, dtype=bool)


# --- FLOPs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExitCosts:
    """The per-token FLOPs of the module docstring's terms, for one model and vocabulary."""

    num_exits: int  # N
    layer: float  # F_layer
    copy: float  # F_copy = 4 d^2
    classifier: float  # 2 V d
    test: float  # 2 d, a halting head's test

    @staticmethod
    def of(config, vocab_size: int, context: Optional[int] = None) -> "ExitCosts":
        """From a parallel config (hidden_dim, mlp_dim, num_heads, num_layers, max_seq_len)."""
        from levanter.utils.flop_utils import lm_flops_per_token

        d = config.hidden_dim
        layer = lm_flops_per_token(
            hidden_dim=d, intermediate_dim=config.mlp_dim, num_layers=1, num_kv_heads=config.num_heads,
            num_heads=config.num_heads, seq_len=context or config.max_seq_len, vocab_size=0,
            glu=config.flavour_spec.gated_mlp,
        )  # fmt: skip
        return ExitCosts(config.num_layers, float(layer), 4.0 * d * d, 2.0 * vocab_size * d, 2.0 * d)

    def threshold(self, exits) -> np.ndarray:
        """F(e) of a confidence-threshold exit at e (array of exits, 1..N)."""
        e = np.asarray(exits, dtype=np.float64)
        return e * self.layer + (self.num_exits - e) * self.copy + e * self.classifier

    def halting(self, exits) -> np.ndarray:
        """F(e) of a halting-head exit at e."""
        e = np.asarray(exits, dtype=np.float64)
        tests = np.minimum(e, self.num_exits - 1)
        return e * self.layer + (self.num_exits - e) * self.copy + tests * self.test + self.classifier

    def fixed(self, n: int) -> float:
        """n blocks and one classifier: the n-layer model, or every token at exit n."""
        return n * self.layer + self.classifier


def mean_flops(per_exit_weight: np.ndarray, cost: Callable) -> float:
    """Weighted mean of cost(e) over tokens, from the weight of tokens at each exit (index e-1)."""
    w = np.asarray(per_exit_weight, dtype=np.float64)
    return float(np.sum(w * cost(np.arange(1, len(w) + 1))) / np.sum(w))


# --- scores -------------------------------------------------------------------------------------
def _targets(tokens: NamedArray, loss_weight: Optional[NamedArray]):
    Pos = tokens.axes[-1]
    target = hax.roll(tokens, -1, Pos)
    weight = hax.logical_not(hax.nn.one_hot(-1, Pos, dtype=jnp.bool_)).astype(jnp.float32)
    if loss_weight is not None:
        weight = weight * loss_weight.astype(jnp.float32)
    return target, weight


def _token_scores(logits: NamedArray, target: NamedArray):
    Vocab = logits.resolve_axis("vocab")
    logp = hax.nn.log_softmax(logits.astype(jnp.float32), Vocab)
    nll = -hax.take(logp, Vocab, target)
    correct = (hax.argmax(logits, Vocab) == target).astype(jnp.float32)
    return nll, correct


def exit_sums(model, tokens: NamedArray, loss_weight: Optional[NamedArray], rule) -> dict:
    """Sums over one batch for exits chosen by `rule` (copy-up): weighted nll, correct, weight, and
    the weight of tokens at each exit (`per_exit`, index e-1)."""
    target, weight = _targets(tokens, loss_weight)
    out = model.exit_forward(tokens, rule)
    nll, correct = _token_scores(out.logits, target)
    per_exit = jnp.stack([hax.sum(weight * (out.exits == n)).array for n in range(1, model.num_exits + 1)])
    return {
        "nll": hax.sum(weight * nll).array,
        "correct": hax.sum(weight * correct).array,
        "weight": hax.sum(weight).array,
        "per_exit": per_exit,
    }


rule_sums = eqx.filter_jit(exit_sums)
"""`exit_sums` compiled; a caller with a new `rule` closure per call jits its own caller instead."""


@eqx.filter_jit
def threshold_sums(model, tokens: NamedArray, loss_weight: Optional[NamedArray], tau) -> dict:
    """`rule_sums` of `confidence_threshold(tau)`, tau traced (one compilation for every tau)."""
    return exit_sums(model, tokens, loss_weight, confidence_threshold(tau))


@eqx.filter_jit
def per_exit_sums(model, tokens: NamedArray, loss_weight: Optional[NamedArray]) -> dict:
    """Sums over one batch at every exit, all tokens through all blocks: nll and correct per exit."""
    target, weight = _targets(tokens, loss_weight)
    nll, correct = _token_scores(model.exit_logits(tokens), target)
    return {
        "nll": hax.sum(weight * nll, axis=tuple(target.axes)).array,
        "correct": hax.sum(weight * correct, axis=tuple(target.axes)).array,
        "weight": hax.sum(weight).array,
    }


@eqx.filter_jit
def plain_sums(model, tokens: NamedArray, loss_weight: Optional[NamedArray]) -> dict:
    """Sums over one batch of a model without exits (its full-depth logits): nll, correct, weight."""
    target, weight = _targets(tokens, loss_weight)
    logits = hax.dot(model.activations(tokens), model.get_lm_head(), axis=model.Embed)
    nll, correct = _token_scores(logits, target)
    return {
        "nll": hax.sum(weight * nll).array,
        "correct": hax.sum(weight * correct).array,
        "weight": hax.sum(weight).array,
    }


def accumulate(parts: Iterable[dict]) -> dict:
    """Sum the per-batch dicts, as float64 numpy."""
    total: dict = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + np.asarray(v, dtype=np.float64)
    return total


def summary(total: dict) -> dict:
    """loss, accuracy (and avg_exit, exit fractions when per-exit weights are there) from `accumulate`d sums."""
    w = float(total["weight"])
    out = {"loss": (total["nll"] / w).tolist(), "accuracy": (total["correct"] / w).tolist(), "tokens": w}
    if "per_exit" in total:
        counts = total["per_exit"]
        out["avg_exit"] = float(np.sum(counts * np.arange(1, len(counts) + 1)) / w)
        out["exit_fractions"] = (counts / w).tolist()
    return out
