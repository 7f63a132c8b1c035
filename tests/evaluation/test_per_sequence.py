"""Vector-field evaluations per sequence of an adaptive solve (`qkvflow eval --per_sequence`).

Hand-built case: a Llama-flavour DiffEqFormer (no biases, no position embeddings) whose token 0 has a
zero embedding. A sequence of token 0 starts at x = 0, where the field is exactly 0 (RMS norm of 0 is
0, so attention and the gated feed-forward give 0): the error estimate is 0 and the PID controller
grows every step by its maximum factor 10, so from dt0 = 1/4 it takes 2 steps (1/4, then the
remaining 3/4). A sequence of random tokens needs more. Solved alone, each sequence must get its own
count; solved as one batch, both get the batch's.
"""

import types

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from levanter.models.lm_model import LmExample

from qkvflow.evaluation import depth
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import build_solver
from qkvflow.integrate.solvers import evaluations
from tests.helpers import Vocab, smooth_model, tiny_config


def test_each_sequence_solved_alone_gets_its_own_count():
    ode = OdeConfig(num_steps=4, solver="tsit5", adaptive=True, rtol=1e-3, atol=1e-4)
    config = tiny_config("llama", ode=ode, initializer_range=0.2, time_scale=1.0)
    model = smooth_model(config)  # non-stiff: a handful of steps for random tokens
    weight = model.token_embeddings.weight
    model = eqx.tree_at(lambda m: m.token_embeddings.weight, model, weight.at[Vocab, 0].set(0.0))
    flow = eqx.filter_jit(lambda m, ids: m.flow(ids)[2])
    zeros = np.zeros(config.max_seq_len, np.int32)
    mixed = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (config.max_seq_len,), 1, Vocab.size), np.int32)
    Batch, Pos = hax.Axis("batch", 2), config.max_Pos

    def alone(ids):
        stats = flow(model, hax.named(ids, Pos))
        return int(stats.num_steps), int(stats.nfe)

    (steps_zero, nfe_zero), (steps_mixed, nfe_mixed) = alone(zeros), alone(mixed)
    assert steps_zero == 2 and nfe_zero == int(evaluations(build_solver(ode), 2))
    assert steps_mixed > 2

    tokens = hax.named(np.stack([zeros, mixed]), (Batch, Pos))
    weights = hax.named(np.ones((2, config.max_seq_len), np.float32), (Batch, Pos))
    batch = hax.vmap(LmExample.causal, Batch)(tokens, loss_weight=weights)
    padded = hax.vmap(LmExample.causal, Batch)(tokens, loss_weight=weights.at[Batch, 1].set(0.0))
    evaluator = types.SimpleNamespace(loader=[(batch, None), (padded, None)], axis_mapping=None)
    mp = types.SimpleNamespace(cast_to_compute=lambda m: m)
    counts = depth.per_sequence_evaluations(model, evaluator, mp)
    np.testing.assert_array_equal(counts, [nfe_zero, nfe_mixed, nfe_zero])  # the weightless row is left out
    batched = int(flow(model, tokens).nfe)
    assert batched >= nfe_mixed > nfe_zero  # one step size for the batch: the zero sequence pays for the other

    d = depth.distribution(counts)
    assert d == {
        "sequences": 3, "mean": (2 * nfe_zero + nfe_mixed) / 3, "min": nfe_zero,
        "q10": nfe_zero, "q50": nfe_zero, "q90": nfe_zero + 0.8 * (nfe_mixed - nfe_zero), "max": nfe_mixed,
    }  # fmt: skip
