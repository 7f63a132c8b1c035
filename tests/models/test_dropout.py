"""DiffEqFormer dropout (`embed_pdrop`, `resid_pdrop`): off by default and at evaluation, and in a
training step exactly the rule of qkvflow.models.fields.dropout, checked against numpy:

    x(0) = D_e * (E[ids] + P[positions]),   one Euler step of size 1:  x(1) = x(0) + D_a * A + D_m * M

with D a 0/1 mask divided by 1 - p and A, M the block's branches written from the equations
(tests/models/test_official.py's reference of the authors' block).
"""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.models.lm_model import LmExample

from qkvflow.integrate.config import OdeConfig
from qkvflow.training.loss import lm_loss
from tests.helpers import Batch, random_tokens, tiny_config, tiny_model
from tests.models.test_official import official_branches, official_embedding, official_model, official_weights

KEY = jax.random.PRNGKey(7)
flow = eqx.filter_jit(lambda m, ids, key: m.flow(ids, key=key)[0].rearrange(("batch", "position", "embed")).array)


def pinned_defaults():
    config = tiny_config("gpt2")
    assert config.embed_pdrop == 0.0 and config.resid_pdrop == 0.0


def _example(config):
    return hax.vmap(LmExample.causal, Batch)(random_tokens(config))


def test_no_dropout_by_default_and_a_key_changes_nothing():
    pinned_defaults()
    model = tiny_model(tiny_config("gpt2"))
    ids = random_tokens(model.config)
    assert np.array_equal(flow(model, ids, KEY), flow(model, ids, None))
    example = _example(model.config)
    with_key, _ = lm_loss(model, example, key=KEY)
    without, _ = lm_loss(model, example)
    assert with_key.array.tobytes() == without.array.tobytes()


def test_evaluation_ignores_dropout():
    """Without a key (Levanter's evaluator, qkvflow's eval and generate) p > 0 computes what p = 0 does."""
    plain = tiny_model(tiny_config("gpt2"))
    dropped = tiny_model(tiny_config("gpt2", embed_pdrop=0.5, resid_pdrop=0.5))
    ids = random_tokens(plain.config)
    assert np.array_equal(flow(dropped, ids, None), flow(plain, ids, None))
    example = _example(plain.config)
    loss = lambda m: m.compute_next_token_loss(example).array  # noqa: E731  (Levanter's eval: no key)
    assert np.array_equal(loss(dropped), loss(plain))
    trained, _ = lm_loss(dropped, example, key=KEY)  # a training step drops out
    assert abs(float(trained.array) - float(lm_loss(dropped, example)[0].array)) > 1e-4
    levanter_step = dropped.compute_next_token_loss(example, key=KEY).array  # Levanter's own loss, given a key
    assert not np.array_equal(levanter_step, loss(dropped))


def test_embedding_dropout_zeroes_and_scales_the_embedding():
    """A zero generator makes F = 0, so x(1) = x(0) = D_e * (E[ids] + P[pos]) entry by entry."""
    p = 0.3
    model = tiny_model(tiny_config("gpt2", embed_pdrop=p))
    model = eqx.tree_at(lambda m: m.generator, model, jax.tree_util.tree_map(jnp.zeros_like, model.generator))
    ids = random_tokens(model.config)
    x1 = np.asarray(flow(model, ids, KEY), dtype=np.float64)
    x0 = np.stack([official_embedding(model, np.asarray(ids["batch", b].array)) for b in range(ids.shape["batch"])])
    kept = x1 != 0
    np.testing.assert_allclose(x1[kept], x0[kept] / (1 - p), rtol=1e-6)
    share = 1 - kept.mean()  # of n entries; binomial std sqrt(p (1 - p) / n)
    assert abs(share - p) < 5 * np.sqrt(p * (1 - p) / kept.size), share
    assert not np.array_equal(x1, flow(model, ids, jax.random.PRNGKey(8)))  # another key, other masks


def test_residual_dropout_masks_each_branch_and_scales_by_one_over_keep():
    """One Euler step, dt = 1, of the official block: each entry of x(1) - x(0) is one of
    0, A / (1 - p), M / (1 - p), (A + M) / (1 - p), in the proportions p^2, p (1 - p), p (1 - p), (1 - p)^2."""
    p = 0.4
    base = official_model(1, "right", resid_pdrop=p)
    ids = random_tokens(base.config)
    x1 = np.asarray(flow(base, ids, KEY), dtype=np.float64)
    w = official_weights(base.generator, 1.0, base.config.num_frequencies)  # right grid: W(1) for the step
    hits = np.zeros(4)
    for b in range(ids.shape["batch"]):
        x0 = official_embedding(base, np.asarray(ids["batch", b].array))
        attn, ff = official_branches(x0, w, base.config.layer_norm_epsilon)
        options = np.stack([0 * attn, attn, ff, attn + ff]) / (1 - p)
        dist = np.abs(x1[b] - x0 - options)
        scale = np.abs(options).max()
        assert (dist.min(0) < 2e-4 * scale).all()  # float32 round-off, as test_official's logits
        hits += np.bincount(dist.argmin(0).ravel(), minlength=4)
    expected = np.array([p * p, p * (1 - p), p * (1 - p), (1 - p) ** 2])
    n = hits.sum()
    assert (np.abs(hits / n - expected) < 5 * np.sqrt(expected * (1 - expected) / n)).all(), hits / n
    assert np.array_equal(x1, flow(base, ids, KEY))  # one key, one set of masks


def test_the_backward_pass_sees_the_forward_masks():
    """Recomputing steps (recursive_checkpoint keeping 1 state of 4) gives the gradient
    of storing every step (direct): the recomputed field draws the forward pass's masks."""

    def grads(**ode):
        config = tiny_config("gpt2", embed_pdrop=0.1, resid_pdrop=0.3, ode=OdeConfig(num_steps=4, **ode))
        model = tiny_model(config)
        g = eqx.filter_grad(lambda m: lm_loss(m, _example(m.config), key=KEY)[0].array)(model)
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(g)]

    direct = grads(adjoint="direct")
    scale = max(np.abs(g).max() for g in direct)
    assert np.isfinite(scale) and scale > 0
    for a, b in zip(direct, grads(checkpoints=1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)  # float32 round-off of a re-run


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"embed_pdrop": 1.0}, "embed_pdrop"),
        ({"resid_pdrop": -0.1}, "resid_pdrop"),
        ({"resid_pdrop": 0.1, "ode": OdeConfig(solver="tsit5")}, "adaptive"),
        ({"embed_pdrop": 0.1, "exits": "aligned"}, "exits"),
        ({"resid_pdrop": 0.1, "ode": OdeConfig(adjoint="backsolve")}, "backsolve"),
    ],
)
def test_bad_dropout_is_refused_in_one_line(overrides, message):
    with pytest.raises(Exception) as info:
        tiny_config("gpt2", **overrides)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1


def test_a_multi_stage_solver_takes_the_masks_of_each_stage_time():
    """RK4 draws masks per stage time; the solve is still deterministic for one key and differs from Euler's."""
    config = tiny_config("gpt2", resid_pdrop=0.3, ode=OdeConfig(num_steps=2, solver="rk4"))
    model = tiny_model(config)
    ids = random_tokens(config)
    a = flow(model, ids, KEY)
    assert np.array_equal(a, flow(model, ids, KEY)) and not np.array_equal(a, flow(model, ids, None))
    euler = dataclasses.replace(model, _config=dataclasses.replace(config, ode=OdeConfig(num_steps=2)))
    assert not np.array_equal(a, flow(euler, ids, KEY))


def test_masks_are_a_function_of_the_solver_time():
    """Same t, same masks (stages and recomputation agree); another t, other masks (one pair per step)."""
    from qkvflow.models.fields.dropout import branch_dropout, time_key

    x = hax.ones(hax.Axis("embed", 256))
    masks = lambda t: [a.array for a in branch_dropout(x, x, 0.5, time_key(KEY, jnp.float32(t)))]  # noqa: E731
    a, b = masks(0.25)
    assert np.array_equal(masks(0.25)[0], a) and not np.array_equal(a, b)  # the branches' masks differ
    assert not np.array_equal(masks(0.5)[0], a) and not np.array_equal(masks(0.25 + 2**-24)[0], a)
    assert time_key(None, 0.25) is None
