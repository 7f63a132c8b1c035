"""Loss against depth for a DiffEqFormer with exits: per-exit losses and a sweep of the halting threshold.

For each batch of held-out sequences (`batches`: LmExample-like, `tokens` and `loss_weight`), over the
weighted target positions i (weight w_i, the last position excluded):

    exit loss k        = sum_i w_i CE(logits_k)_i / sum_i w_i                     (no halting)
    loss(tau)          = sum_i w_i CE(logits at token i's exit)_i / sum_i w_i     (`halting_flow`)
    mean NFE(tau)      = sum_i w_i NFE_i / sum_i w_i
    mean exit time     = sum_i w_i (k_i / N) / sum_i w_i
    FLOPs/token(tau)   = head + layer * NFE + kv * (NFE_full - NFE) + 2 V d * tests

`layer` is one field evaluation per token and `head` the final readout (Levanter's `lm_flops_per_token`
at the run's context, as `qkvflow.models.accounting`), `kv` = 2 * 2 d^2 the keys and values a frozen
token still needs at every later evaluation so that the others can attend to it, and 2 V d the readout of
each threshold test. The hypernetwork's W(t), generated once per evaluation time for the whole batch,
is the same at every tau and left out.

tau = inf (never halt) is read from the last exit rather than solved again (`halting_flow` at tau = inf
gives the same states: tests/models/test_ode_exits.py).

`choose_tau`: the threshold with the fewest mean NFE whose loss on the selection split is within
`slack` nats of the unhalted loss there; it is then reported on the test split.
"""

from __future__ import annotations

import math

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from levanter.utils.flop_utils import lm_flops_per_token

from qkvflow.models.accounting import nominal_evaluations
from qkvflow.models.related.ode_exits import exit_states, halting_flow, readout


def _next_token_nll(logits, tokens, weight, Pos, Vocab):
    """(sum_i w_i nll_i, per-position w_i with the last position dropped)."""
    target = hax.roll(tokens, -1, Pos)
    not_last = 1.0 - hax.nn.one_hot(-1, Pos, dtype=jnp.float32)
    w = weight.astype(jnp.float32) * not_last
    logits = logits.astype(jnp.float32)
    nll = hax.nn.logsumexp(logits, Vocab) - hax.take(logits, Vocab, target)
    return nll, w


@eqx.filter_jit
def _exit_sums(model, tokens, weight):
    xs, _, _ = exit_states(model, tokens)
    nll, w = _next_token_nll(readout(model, xs), tokens, weight, model.Pos, model.Vocab)
    axes = tuple(a for a in w.axes)
    return hax.sum(nll * w, axes).array, hax.sum(w).array


@eqx.filter_jit
def _halting_sums(model, tokens, weight, tau):
    h = halting_flow(model, tokens, tau)
    nll, w = _next_token_nll(h.logits, tokens, weight, model.Pos, model.Vocab)
    total = lambda a: hax.sum(a * w).array  # noqa: E731
    return {
        "nll": total(nll),
        "nfe": total(h.nfe.astype(jnp.float32)),
        "exit_step": total(h.exit_step.astype(jnp.float32)),
        "tests": total(h.tests.astype(jnp.float32)),
        "halted": total((h.exit_step < model.config.ode.num_steps).astype(jnp.float32)),
        "weight": hax.sum(w).array,
    }


def flop_terms(config, vocab_size: int, context_length: int) -> dict:
    """Per-token FLOPs of one field evaluation, the final readout, a frozen token's keys and values
    per evaluation, and one threshold test (the module docstring)."""

    def lm(layers):
        return lm_flops_per_token(
            hidden_dim=config.hidden_dim,
            intermediate_dim=config.mlp_dim,
            num_layers=layers,
            num_kv_heads=config.num_heads,
            num_heads=config.num_heads,
            seq_len=context_length,
            vocab_size=vocab_size,
            glu=config.flavour_spec.gated_mlp,
        )

    layer = lm(2) - lm(1)
    d = config.hidden_dim
    return {"layer": layer, "head": lm(1) - layer, "kv": 4.0 * d * d, "test": 2.0 * vocab_size * d}


def evaluate(model, batches, taus, *, context_length: int) -> dict:
    """Per-exit losses and one row per tau (the module docstring) over `batches`."""
    config = model.config
    n = config.ode.num_steps
    exit_nll, weight = np.zeros(n), 0.0
    sums = {tau: {} for tau in taus}
    for batch in batches:
        nll, w = _exit_sums(model, batch.tokens, batch.loss_weight)
        exit_nll += np.asarray(nll, np.float64)
        weight += float(w)
        for tau in taus:
            if math.isinf(tau):  # nothing halts: the last exit, N evaluations per step, N - 1 tests
                per_step = nominal_evaluations(config) / n
                out = {"nll": nll[-1], "nfe": per_step * n * w, "exit_step": n * w, "tests": (n - 1) * w, "halted": 0.0}
                out["weight"] = w
            else:
                out = _halting_sums(model, batch.tokens, batch.loss_weight, jnp.float32(tau))
            for key, value in out.items():
                sums[tau][key] = sums[tau].get(key, 0.0) + float(value)
    flops = flop_terms(config, model.Vocab.size, context_length)
    full_nfe = nominal_evaluations(config)
    rows = []
    for tau in taus:
        s = sums[tau]
        w = s["weight"]
        nfe = s["nfe"] / w
        tests = s["tests"] / w
        rows.append(
            {
                "tau": tau,
                "loss": s["nll"] / w,
                "mean_nfe": nfe,
                "nfe_saved": 1.0 - nfe / full_nfe,
                "mean_exit_time": s["exit_step"] / w / n,
                "halted_fraction": s["halted"] / w,
                "tests_per_token": tests,
                "flops_per_token": flops["head"]
                + flops["layer"] * nfe
                + flops["kv"] * (full_nfe - nfe)
                + flops["test"] * tests,
            }
        )
    return {
        "exit_times": [k / n for k in range(1, n + 1)],
        "exit_losses": list(exit_nll / weight),
        "full_nfe": full_nfe,
        "full_flops_per_token": flops["head"] + flops["layer"] * full_nfe,
        "flop_terms": flops,
        "tokens": weight,
        "rows": rows,
    }


def choose_tau(selection: dict, slack: float) -> float:
    """The tau of `selection['rows']` with the fewest mean NFE whose loss is within `slack` of the
    unhalted exit-N loss (math.inf, no halting, if none is)."""
    limit = selection["exit_losses"][-1] + slack
    ok = [r for r in selection["rows"] if r["loss"] <= limit]
    if not ok:
        return math.inf
    return min(ok, key=lambda r: (r["mean_nfe"], -r["tau"]))["tau"]
