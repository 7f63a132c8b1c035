"""Depth-adaptive exits of the DiffEqFormer (qkvflow.models.related.ode_exits) against references written here.

The references are float64 numpy Euler loops over the GPT-2 field of tests/models/test_field_reference.py
(written from the equations, not from the model's field code), with the model's parameters and W(t_k):

    x_{k+1} = x_k + (1 - h) * F(W(t_k), x_k) / N,     exit k: norm(x_k) @ U,    t_k = k / N
    aligned loss = 1/N sum_k CE(exit k)
"""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.models.lm_model import LmExample
from levanter.models.loss import maybe_fused_next_token_loss

from qkvflow.errors import UserError
from qkvflow.evaluation import ode_halting
from qkvflow.integrate.config import OdeConfig
from qkvflow.models.related.ode_exits import exit_states, halting_flow, readout
from qkvflow.training.loss import lm_loss
from tests.helpers import Vocab, random_tokens, tiny_config, tiny_model
from tests.models.test_field_reference import _np, generated_weights, gpt2_field, layer_norm

N = 3
halt = eqx.filter_jit(halting_flow)  # one compilation per model and pattern kind, shared by the tests
states_at_exits = eqx.filter_jit(exit_states)
EPS32 = np.finfo(np.float32).eps
INF = jnp.float32(jnp.inf)


@pytest.fixture(scope="module")
def aligned():
    config = tiny_config("gpt2", ode=OdeConfig(num_steps=N), initializer_range=0.2, exits="aligned")
    return config, tiny_model(config)


def reference_states(model, ids, halted_from=None, attend_to_frozen=True):
    """x(t_0..t_N) (numpy, one sequence) by the Euler loop above; `halted_from[i]` = k freezes token i
    after grid time t_k (None: no halting). With attend_to_frozen=False the frozen tokens are also
    dropped from the other tokens' attention (a wrong variant, to show that the model attends to them)."""
    config = model.config
    tokens = np.asarray(ids.array)
    x = _np(model.token_embeddings.weight, "vocab", "embed")[tokens]
    x = x + _np(model.position_embeddings.weight, "position", "embed")[: len(tokens)]
    states = [x]
    for k in range(N):
        live = np.ones(len(tokens)) if halted_from is None else (np.asarray(halted_from) > k).astype(float)
        w = generated_weights(model, k / N)
        if attend_to_frozen:
            dx = gpt2_field(w, x, config.layer_norm_epsilon, config.num_heads)
        else:  # each live token attends to live tokens only (every token sees itself)
            dx = np.zeros_like(x)
            for i in range(len(tokens)):
                keep = [j for j in range(i + 1) if live[j] or j == i]
                dx[i] = gpt2_field(w, x[keep], config.layer_norm_epsilon, config.num_heads)[-1]
        x = x + live[:, None] * dx / N
        states.append(x)
    return states


def reference_logits(model, x):
    norm = model.final_norm
    h = layer_norm(x, _np(norm.weight, "embed"), _np(norm.bias, "embed"), model.config.layer_norm_epsilon)
    return h @ _np(model.get_lm_head(), "embed", "vocab")


def reference_ce(logits, tokens):
    log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    return float(np.mean(log_z[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]]))


def test_aligned_loss_is_the_mean_of_the_exit_losses(aligned):
    config, model = aligned
    ids = random_tokens(config)["batch", 0]
    tokens = np.asarray(ids.array)
    states = reference_states(model, ids)
    per_exit = [reference_ce(reference_logits(model, states[k]), tokens) for k in range(1, N + 1)]
    loss, metrics = eqx.filter_jit(lm_loss)(model, LmExample.causal(ids))
    # float32 round-off of the logits (as test_field_reference: 4 ulps per step of their scale) moves a
    # mean CE by at most about twice that; the float32 mean over the positions adds a few ulps of the loss
    # (sqrt(positions) in a random walk, 4 as margin)
    scale = max(np.max(np.abs(reference_logits(model, s))) for s in states[1:])
    tol = 2 * 4 * N * EPS32 * scale + 4 * np.sqrt(len(tokens)) * EPS32 * max(per_exit)
    np.testing.assert_allclose(float(loss), np.mean(per_exit), rtol=0, atol=tol)
    for k in range(1, N + 1):
        np.testing.assert_allclose(float(metrics[f"ode_exit_loss_{k}"].value()), per_exit[k - 1], rtol=0, atol=tol)
    assert float(metrics["ode_nfe"].value()) == N
    # the exits differ by far more than the tolerance: a loss of the last exit alone would fail
    assert np.ptp(per_exit) > 100 * tol


def test_exits_are_off_by_default_and_leave_the_loss_bit_identical():
    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config

    assert DiffEqFormerGpt2Config().exits == "none"
    config = tiny_config("gpt2", initializer_range=0.2)
    model = tiny_model(config)
    example = LmExample.causal(random_tokens(config)["batch", 0])

    def before(model, example):  # the loss of a DiffEqFormer before exits existed
        x, _, stats = model.flow(example.tokens, example.attn_mask)
        loss = maybe_fused_next_token_loss(
            model.Pos, model.Embed, model.Vocab, model.final_norm(x), model.get_lm_head(), example.tokens,
            loss_weight=example.loss_weight, logsumexp_weight=0.0, dtype=jnp.float32, block_size=None,
        )  # fmt: skip
        return loss, stats.nfe.astype(jnp.float32), stats.num_steps.astype(jnp.float32)

    ours = jax.make_jaxpr(lambda m, e: lm_loss(m, e)[0])(model, example)
    theirs = jax.make_jaxpr(lambda m, e: before(m, e)[0])(model, example)
    assert str(ours) == str(theirs)  # the same program, so the same numbers, bit for bit
    # and the exits' readout does change it: the check can fail
    aligned = dataclasses.replace(model, _config=dataclasses.replace(config, exits="aligned"))
    assert str(jax.make_jaxpr(lambda m, e: lm_loss(m, e)[0])(aligned, example)) != str(theirs)


def test_all_tokens_halting_at_t_k_end_at_x_t_k(aligned):
    config, model = aligned
    ids = random_tokens(config)
    xs, _, _ = states_at_exits(model, ids)
    for k in range(1, N + 1):
        h = halt(model, ids, INF, halt_at=hax.full(ids.axes, k, jnp.int32))
        unhalted = xs["exit", k - 1]
        scale = float(jnp.max(jnp.abs(unhalted.array)))
        np.testing.assert_allclose(
            h.state.rearrange(unhalted.axes).array, unhalted.array, rtol=0, atol=4 * EPS32 * scale
        )
        exit_logits = readout(model, unhalted)
        tol = 4 * EPS32 * float(jnp.max(jnp.abs(exit_logits.array)))
        np.testing.assert_allclose(h.logits.rearrange(exit_logits.axes).array, exit_logits.array, rtol=0, atol=tol)
        assert np.all(np.asarray(h.nfe.array) == k) and np.all(np.asarray(h.exit_step.array) == k)
    # the confidence rule: tau 0 halts everything at t_1, tau = inf nothing (the model's own x(1))
    assert np.all(np.asarray(halt(model, ids, jnp.float32(0.0)).exit_step.array) == 1)
    never = halt(model, ids, INF)
    np.testing.assert_allclose(
        never.state.rearrange(unhalted.axes).array, unhalted.array, rtol=0, atol=4 * EPS32 * scale
    )


def test_a_halted_token_is_frozen_and_the_others_still_attend_to_it(aligned):
    config, model = aligned
    batch = random_tokens(config)
    ids = batch["batch", 0]
    j, n_pos = 3, config.max_seq_len
    pattern = np.full(n_pos, N)  # N: never halts
    pattern[j] = 1
    halt_at = hax.broadcast_to(hax.named(jnp.asarray(pattern, jnp.int32), ids.axes), batch.axes)
    h = halt(model, batch, INF, halt_at=halt_at)
    ours = np.asarray(h.state["batch", 0].rearrange(("position", "embed")).array, np.float64)
    frozen = reference_states(model, ids, halted_from=pattern)
    tol = 4 * N * EPS32 * np.max(np.abs(frozen[-1]))
    np.testing.assert_allclose(ours, frozen[-1], rtol=0, atol=tol)
    # token j kept its state x_j(t_1), while it moved on in the unhalted solve
    unhalted = reference_states(model, ids)
    np.testing.assert_allclose(ours[j], unhalted[1][j], rtol=0, atol=tol)
    assert np.max(np.abs(unhalted[-1][j] - unhalted[1][j])) > 100 * tol
    # tokens before j see nothing of it; tokens after j differ from the unhalted solve, and only through
    # attention to j's frozen state: dropping it from their attention gives another result
    np.testing.assert_allclose(ours[:j], unhalted[-1][:j], rtol=0, atol=tol)
    assert np.min(np.max(np.abs(ours[j + 1 :] - unhalted[-1][j + 1 :]), -1)) > 10 * tol
    blind = reference_states(model, ids, halted_from=pattern, attend_to_frozen=False)
    assert np.min(np.max(np.abs(ours[j + 1 :] - blind[-1][j + 1 :]), -1)) > 10 * tol


def test_halting_decisions_and_logits_are_causal(aligned):
    config, model = aligned
    ids = random_tokens(config)
    xs, _, _ = states_at_exits(model, ids)
    logits = readout(model, xs["exit", 0])
    confidence = hax.exp(hax.max(logits, Vocab) - hax.nn.logsumexp(logits, Vocab))
    tau = float(jnp.median(confidence.array))  # about half the tokens halt at t_1
    i = 6
    Pos = config.max_Pos
    changed = ids.at[Pos, i + 1 :].set((ids[Pos, i + 1 :] + 7) % Vocab.size)
    a, b = halt(model, ids, jnp.float32(tau)), halt(model, changed, jnp.float32(tau))
    halted = np.asarray(a.exit_step.array) < N
    assert 0 < halted.mean() < 1
    for name in ("exit_step", "nfe", "tests", "logits"):
        x, y = getattr(a, name)[Pos, : i + 1], getattr(b, name)[Pos, : i + 1]
        np.testing.assert_allclose(np.asarray(x.array), np.asarray(y.array), rtol=0, atol=1e-6, err_msg=name)
    assert not np.allclose(a.logits[Pos, i + 1 :].array, b.logits[Pos, i + 1 :].array, atol=1e-4)


@pytest.mark.parametrize("solver,stages", [("euler", 1), ("heun", 2)])
def test_nfe_and_tests_on_a_hand_built_halting_pattern(aligned, solver, stages):
    config, model = aligned
    if solver != "euler":
        config = tiny_config("gpt2", ode=OdeConfig(num_steps=N, solver=solver), initializer_range=0.2)
        model = tiny_model(config)
    ids = random_tokens(config)
    pattern = np.array([[1, 2, 3, 9, 1, 2, 0, 3, 2, 1, 3, 2], [2] * 12])  # 0 (no exit before t_1), >= N: never
    h = halt(model, ids, INF, halt_at=hax.named(jnp.asarray(pattern, jnp.int32), ids.axes))
    exit_step = np.where((pattern >= 1) & (pattern < N), pattern, N)
    np.testing.assert_array_equal(np.asarray(h.exit_step.array), exit_step)
    np.testing.assert_array_equal(np.asarray(h.nfe.array), stages * exit_step)
    np.testing.assert_array_equal(np.asarray(h.tests.array), np.minimum(exit_step, N - 1))
    if solver == "heun":  # segment by segment on the model's own grid: unhalted, the x(1) of its solve
        never = halt(model, ids, INF, halt_at=hax.full(ids.axes, N, jnp.int32))
        x1 = eqx.filter_jit(model.flow)(ids)[0]
        scale = float(jnp.max(jnp.abs(x1.array)))
        np.testing.assert_allclose(never.state.rearrange(x1.axes).array, x1.array, rtol=0, atol=4 * EPS32 * scale)


def test_sweep_metrics_at_the_extremes(aligned):
    config, model = aligned
    ids = random_tokens(config)
    batch = LmExample(ids, hax.ones(ids.axes), None)
    out = ode_halting.evaluate(model, [batch], [0.0, float("inf")], context_length=config.max_seq_len)
    first, never = out["rows"]
    assert first["mean_nfe"] == 1 and first["mean_exit_time"] == 1 / N and first["tests_per_token"] == 1
    assert never["mean_nfe"] == N and never["mean_exit_time"] == 1 and never["tests_per_token"] == N - 1
    np.testing.assert_allclose(first["loss"], out["exit_losses"][0], rtol=1e-6)
    np.testing.assert_allclose(never["loss"], out["exit_losses"][-1], rtol=1e-6)
    f = out["flop_terms"]
    assert first["flops_per_token"] == f["head"] + f["layer"] + f["kv"] * (N - 1) + f["test"]
    assert f["test"] == 2 * Vocab.size * config.hidden_dim and f["kv"] == 4 * config.hidden_dim**2


def test_bad_exit_configs_are_refused_naming_the_key():
    with pytest.raises(UserError, match="exits='sometimes' is invalid"):
        tiny_config("gpt2", exits="sometimes")
    with pytest.raises(UserError, match="exits='aligned' is invalid.*adaptive.*tsit5"):
        tiny_config("gpt2", ode=OdeConfig(solver="tsit5"), exits="aligned")
    adaptive = tiny_model(tiny_config("gpt2", ode=OdeConfig(solver="tsit5")))
    ids = random_tokens(adaptive.config)
    with pytest.raises(UserError, match="ode.solver='tsit5' is adaptive"):
        halting_flow(adaptive, ids, 0.5)
    with pytest.raises(UserError, match="ode.solver='tsit5' is adaptive"):
        exit_states(adaptive, ids)


def test_evaluation_at_another_grid_reads_an_aligned_model_at_t_1(aligned):
    """`qkvflow eval --tolerances` (qkvflow.evaluation.depth.with_ode) must not refuse an aligned checkpoint:
    evaluation reads t = 1 alone, so the copy it evaluates has no exits, and any grid applies."""
    from qkvflow.evaluation.depth import with_ode

    _, model = aligned
    adaptive = with_ode(model, OdeConfig(solver="tsit5"))
    assert adaptive.config.exits == "none" and adaptive.config.ode.is_adaptive
    assert with_ode(model, OdeConfig(num_steps=5)).config.ode.num_steps == 5
