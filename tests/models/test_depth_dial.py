"""The depth-dial training recipes (qkvflow.models.depth_dial, qkvflow.training.loss), each against a
reference written here: Euler and Heun on the drawn grid, the KL from its definition, the Jacobian from
the explicit matrix. Resume of a run that draws grids: tests/test_train.py."""

import dataclasses
import functools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmExample

from qkvflow.errors import UserError
from qkvflow.integrate.config import OdeConfig
from qkvflow.models.depth_dial import DepthDialConfig, drawn_solves, refine, sample_grid, solve, stage_shift
from qkvflow.training.loss import consistency_kl, lm_loss
from tests.helpers import Batch, random_tokens, smooth_model, tiny_config

EPS = np.finfo(np.float32).eps


def _model(dial=None, ode=None, **overrides):
    kwargs = dict(max_seq_len=4, hidden_dim=8, num_heads=2, time_embed_dim=4, num_frequencies=4, time_scale=3.0)
    config = tiny_config(ode=ode or OdeConfig(num_steps=4), dial=dial or DepthDialConfig(), **(kwargs | overrides))
    return smooth_model(config)


def _without(model, **changes):
    """`model` with its config changed (no recipes, unless given)."""
    config = dataclasses.replace(model.config, **({"dial": DepthDialConfig()} | changes))
    return dataclasses.replace(model, _config=config)


def test_jittered_times_stay_in_their_intervals_and_span_0_1():
    """t_0 = 0, t_n = 1, each inner t_k within jitter/2 of a step of k/n (so increasing), and over many
    draws each t_k lands on both sides of k/n (it is jittered, not the uniform grid)."""
    n, jitter = 5, 0.8
    dial = DepthDialConfig(jitter=jitter)
    grids = np.stack([np.asarray(sample_grid(n, dial, jrandom.PRNGKey(s))) for s in range(200)])
    assert grids.shape == (200, n + 1)
    np.testing.assert_array_equal(grids[:, 0], 0.0)
    np.testing.assert_array_equal(grids[:, -1], 1.0)
    offset = grids[:, 1:-1] * n - np.arange(1, n)  # in steps
    assert np.all(np.abs(offset) <= jitter / 2 + 8 * EPS)
    assert np.all(np.diff(grids, axis=1) > 0)
    assert np.all(offset.min(axis=0) < -0.3 * jitter) and np.all(offset.max(axis=0) > 0.3 * jitter)
    assert sample_grid(n, DepthDialConfig(), jrandom.PRNGKey(0)) is None  # no jitter: the uniform grid


def test_steer_scales_the_grid_to_a_random_end_time():
    dial = DepthDialConfig(steer=0.25)
    ends = np.array([float(sample_grid(4, dial, jrandom.PRNGKey(s))[-1]) for s in range(100)])
    assert np.all((ends >= 0.75) & (ends <= 1.25)) and ends.min() < 0.85 and ends.max() > 1.15
    grid = np.asarray(sample_grid(4, dial, jrandom.PRNGKey(3)))
    np.testing.assert_allclose(grid, np.linspace(0, 1, 5) * grid[-1], rtol=0, atol=4 * EPS)


def test_grids_are_a_function_of_the_key():
    dial = DepthDialConfig(jitter=0.5, steer=0.1)
    a, b = (np.asarray(sample_grid(4, dial, jrandom.PRNGKey(s))) for s in (7, 7))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, np.asarray(sample_grid(4, dial, jrandom.PRNGKey(8))))


def test_refine_cuts_each_interval_into_equal_parts():
    grid = jnp.array([0.0, 0.2, 0.7, 1.0])
    np.testing.assert_allclose(refine(grid, 2), [0, 0.1, 0.2, 0.45, 0.7, 0.85, 1.0], rtol=0, atol=4 * EPS)


@pytest.mark.parametrize("solver,cache", [("euler", "precompute"), ("heun", "on_the_fly"), ("heun", "precompute")])
def test_solve_on_a_drawn_grid_is_the_method_on_that_grid(solver, cache):
    """x_{k+1} from the method's formula with h_k = t_{k+1} - t_k and W generated at the stage times, for
    both weight caches (the precomputed table must hold W at the drawn times, not the uniform ones)."""
    ode = OdeConfig(num_steps=3, solver=solver, weight_cache=cache)
    model = _model(ode=ode)
    tokens = random_tokens(model.config, batch=Batch)
    grid = sample_grid(3, DepthDialConfig(jitter=0.9, steer=0.2), jrandom.PRNGKey(1))
    x, _, _, _ = eqx.filter_jit(solve)(model, tokens, None, ode, grid)
    x0 = model.embed(tokens, hax.arange(model.Pos, dtype=jnp.int32))
    f = jax.jit(functools.partial(_field_at, model, x0.axes))
    y, g = x0.array, np.asarray(grid)
    for t, h in zip(g[:-1], np.diff(g)):
        k1 = f(t, y)
        y = y + h * k1 if solver == "euler" else y + h / 2 * (k1 + f(t + h, y + h * k1))
    scale = float(jnp.max(jnp.abs(y)))
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=64 * EPS * scale)


def test_random_time_shifts_stay_inside_their_steps_and_leave_the_grid_alone():
    """v_k h_k with v_k in [0, 1): each generation time t_k + shift_k lies in [t_k, t_{k+1}), both halves of
    every step are reached over keys, the same key gives the same shifts, and the grid is the one drawn
    without the recipe (a fold of the key, so `jitter`'s draws do not move)."""
    n = 4
    dial = DepthDialConfig(jitter=0.5, random_time=True)
    fractions = []
    for s in range(200):
        key = jrandom.PRNGKey(s)
        grid = sample_grid(n, dial, key)
        np.testing.assert_array_equal(np.asarray(grid), np.asarray(sample_grid(n, DepthDialConfig(jitter=0.5), key)))
        fractions.append(np.asarray(stage_shift(grid, dial, key)) / np.diff(np.asarray(grid)))
    fractions = np.stack(fractions)
    assert fractions.shape == (200, n) and np.all((fractions >= 0) & (fractions < 1 + 8 * EPS))
    assert np.all(fractions.min(axis=0) < 0.2) and np.all(fractions.max(axis=0) > 0.8)
    key = jrandom.PRNGKey(5)
    grid = sample_grid(n, dial, key)
    np.testing.assert_array_equal(np.asarray(stage_shift(grid, dial, key)), np.asarray(stage_shift(grid, dial, key)))
    uniform = sample_grid(n, DepthDialConfig(random_time=True), key)  # random_time alone: the uniform grid
    np.testing.assert_allclose(np.asarray(uniform), np.linspace(0, 1, n + 1), rtol=0, atol=4 * EPS)
    assert stage_shift(grid, DepthDialConfig(jitter=0.5), key) is None


@pytest.mark.parametrize("cache", ["precompute", "on_the_fly"])
def test_random_time_euler_generates_w_at_the_shifted_times(cache):
    """The random Euler scheme, x_{k+1} = x_k + h_k F(W(t_k + s_k), x_k), with W from the generator itself at
    the shifted times, for both weight caches; the drawn training solve is that scheme on its own draws."""
    ode = OdeConfig(num_steps=3, weight_cache=cache)
    dial = DepthDialConfig(jitter=0.6, random_time=True)
    model = _model(ode=ode, dial=dial)
    tokens = random_tokens(model.config, batch=Batch)
    key = jrandom.PRNGKey(2)
    grid = sample_grid(3, dial, key)
    shift = stage_shift(grid, dial, key)
    x, _, _, _ = eqx.filter_jit(solve)(model, tokens, None, ode, grid, shift=shift)
    x0 = model.embed(tokens, hax.arange(model.Pos, dtype=jnp.int32))
    f = jax.jit(functools.partial(_field_at, model, x0.axes))
    y, g, sh = x0.array, np.asarray(grid), np.asarray(shift)
    for t, h, s in zip(g[:-1], np.diff(g), sh):
        y = y + h * f(t + s, y)
    scale = float(jnp.max(jnp.abs(y)))
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=64 * EPS * scale)
    # the training solve: one count (3), the grid and shifts drawn from the grid's key
    _, k_grid, _ = jrandom.split(key, 3)
    drawn, *_ = jax.jit(lambda k: drawn_solves(model, tokens, None, k))(key)
    grid = sample_grid(3, dial, k_grid)
    shift = stage_shift(grid, dial, k_grid)
    y = x0.array
    for t, h, s in zip(np.asarray(grid)[:-1], np.diff(np.asarray(grid)), np.asarray(shift)):
        y = y + h * f(t + s, y)
    np.testing.assert_allclose(np.asarray(drawn), np.asarray(y), rtol=0, atol=64 * EPS * scale)


def _field_at(model, axes, t, y):
    """F(W(t), x): the generator called at t itself (no grid table)."""
    pos = hax.arange(model.Pos, dtype=jnp.int32)
    dx = model.field.vector_field(
        model.generator(t), hax.named(y, axes), config=model.config, mask=AttentionMask.causal(), pos_ids=pos
    )
    return dx.rearrange(axes).array


def test_drawn_step_count_is_one_of_the_set_and_solves_at_it():
    """With train_steps {1, 2, 4} the drawn count comes from the set, all of it over keys, and x is the
    plain flow at that count (the uniform grid: no jitter)."""
    model = _model(dial=DepthDialConfig(train_steps=(1, 2, 4)))
    tokens = random_tokens(model.config, batch=Batch)
    drawn = jax.jit(lambda key: drawn_solves(model, tokens, None, key))
    seen = set()
    for s in range(12):
        x, fine, energy, frob, stats, count = drawn(jrandom.PRNGKey(s))
        n = int(count)
        seen.add(n)
        assert fine is None and energy is None and frob is None and int(stats.nfe) == n
        config = dataclasses.replace(model.config, ode=OdeConfig(num_steps=n), dial=DepthDialConfig())
        ref, _, _ = dataclasses.replace(model, _config=config).flow(tokens)
        np.testing.assert_allclose(np.asarray(x), ref.array, rtol=0, atol=16 * EPS * float(jnp.max(jnp.abs(ref.array))))
    assert seen == {1, 2, 4}


def test_the_consistency_terms_fine_solve_is_euler_on_the_drawn_grid_with_each_step_halved():
    """With a jittered grid t_0..t_n the fine solve takes 2n Euler steps at t_0, (t_0 + t_1)/2, t_1, ...
    (reference: Euler written here on those times); the coarse one n steps on the grid itself. The two
    differ, so the KL between them has something to train."""
    n, dial = 3, DepthDialConfig(jitter=0.9, consistency_weight=1.0)
    model = _model(dial=dial, ode=OdeConfig(num_steps=n))
    tokens = random_tokens(model.config, batch=Batch)
    key = jrandom.PRNGKey(3)
    x, fine, _, _, stats, _ = jax.jit(lambda key: drawn_solves(model, tokens, None, key))(key)
    grid = np.asarray(sample_grid(n, dial, jrandom.split(key, 3)[1]), np.float64)
    assert np.ptp(np.diff(grid)) > 0.05  # jittered: unequal steps
    halved = np.sort(np.concatenate([grid, (grid[:-1] + grid[1:]) / 2]))
    x0 = model.embed(tokens, hax.arange(model.Pos, dtype=jnp.int32))
    f = jax.jit(functools.partial(_field_at, model, x0.axes))

    def euler(times):
        y = x0.array
        for t, h in zip(times[:-1], np.diff(times)):
            y = y + np.float32(h) * f(np.float32(t), y)
        return np.asarray(y)

    coarse_ref, fine_ref = euler(grid), euler(halved)
    scale = float(np.max(np.abs(fine_ref)))
    np.testing.assert_allclose(np.asarray(fine), fine_ref, rtol=0, atol=64 * EPS * scale)
    np.testing.assert_allclose(np.asarray(x), coarse_ref, rtol=0, atol=64 * EPS * scale)
    assert np.max(np.abs(fine_ref - coarse_ref)) > 1e3 * 64 * EPS * scale
    assert int(stats.nfe) == n + 2 * n


def test_consistency_kl_is_the_definition_and_zero_when_distributions_agree():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 3, 7)), rng.normal(size=(2, 3, 7))
    w = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    p = np.exp(b) / np.exp(b).sum(-1, keepdims=True)  # fine
    q = np.exp(a) / np.exp(a).sum(-1, keepdims=True)  # coarse
    kl = (p * (np.log(p) - np.log(q))).sum(-1)
    np.testing.assert_allclose(consistency_kl(a, b, w), (w * kl).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(consistency_kl(a, b), kl.mean(), rtol=1e-5)
    # the same distributions (logits differing by a constant per position): zero, up to round-off
    assert abs(float(consistency_kl(a, a + 5.0 * rng.normal(size=(2, 3, 1)), w))) < 1e-6


def _loss(model, key):
    tokens = random_tokens(model.config, batch=Batch)
    weight = hax.ones(tokens.axes, dtype=jnp.float32).at[model.Pos, -1].set(0.0)
    example = LmExample(tokens=tokens, loss_weight=weight, attn_mask=AttentionMask.causal())
    return eqx.filter_jit(lm_loss)(model, example, key=key)


def test_training_loss_adds_the_weighted_kl_of_the_coarse_and_fine_solves():
    """loss = CE at N + w * KL(p_2N || p_N), both distributions from the plain model at N and 2N steps;
    evaluation (no key) is the plain loss at N."""
    w = 0.7
    model = _model(dial=DepthDialConfig(consistency_weight=w), ode=OdeConfig(num_steps=1), initializer_range=0.3)
    loss, metrics = _loss(model, jrandom.PRNGKey(0))
    ce, _ = _loss(_without(model), None)
    tokens = random_tokens(model.config, batch=Batch)
    p = {}
    for n in (1, 2):
        logits = _without(model, ode=OdeConfig(num_steps=n))(tokens, attn_mask=AttentionMask.causal())
        z = np.asarray(logits.rearrange((Batch, model.Pos, model.Vocab)).array, np.float64)
        p[n] = np.exp(z - z.max(-1, keepdims=True))
        p[n] /= p[n].sum(-1, keepdims=True)
    kl = (p[2] * (np.log(p[2]) - np.log(p[1]))).sum(-1)[:, :-1].mean()  # the last position has weight 0
    assert kl > 1e-3  # the two solves differ: the term is seen
    np.testing.assert_allclose(float(metrics["dial_consistency_kl"].value()), kl, rtol=1e-3)
    np.testing.assert_allclose(float(loss), float(ce) + w * kl, rtol=1e-5)
    np.testing.assert_allclose(float(_loss(model, None)[0]), float(ce), rtol=0, atol=0)


def test_jacobian_term_is_hutchinson_on_the_explicit_jacobian():
    """Frobenius term with probe e on an Euler grid: sum_k h ||J(t_k, x_k) e||^2 / tokens, J built as a
    matrix (jax.jacfwd) along the reference Euler solve; and the loss adds it with its weight."""
    model = _model(dial=DepthDialConfig(jacobian_weight=0.3), ode=OdeConfig(num_steps=2))
    tokens = random_tokens(model.config, batch=Batch)
    x0 = model.embed(tokens, hax.arange(model.Pos, dtype=jnp.int32))
    probe = jrandom.normal(jrandom.PRNGKey(5), x0.array.shape)
    _, _, frob, _ = eqx.filter_jit(solve)(model, tokens, None, model.config.ode, None, probe)

    f = jax.jit(functools.partial(_field_at, model, x0.axes))
    jacobian = jax.jit(jax.jacfwd(f, argnums=1))
    y, total, size, tokens_count = x0.array, 0.0, x0.array.size, x0.array.size // 8
    for t in (0.0, 0.5):
        jac = np.asarray(jacobian(t, y), np.float64).reshape(size, size)
        total += 0.5 * np.sum(np.square(jac @ np.asarray(probe, np.float64).reshape(-1))) / tokens_count
        y = y + 0.5 * f(t, y)
    np.testing.assert_allclose(float(frob), total, rtol=1e-4)

    loss, metrics = _loss(model, jrandom.PRNGKey(2))
    ce, _ = _loss(_without(model), None)
    term = float(metrics["dial_jacobian_frobenius"].value())
    assert term > 0
    np.testing.assert_allclose(float(loss), float(ce) + 0.3 * term, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"train_steps": (2, 0)}, "dial.train_steps=[2, 0] is invalid: expected integers >= 1"),
        ({"jitter": 1.0}, "dial.jitter=1.0 is invalid: expected a float in [0, 1)"),
        ({"steer": -0.1}, "dial.steer=-0.1 is invalid"),
        ({"consistency_factor": 1}, "dial.consistency_factor=1 is invalid: expected an integer >= 2"),
        ({"jacobian_weight": -1.0}, "dial.jacobian_weight=-1.0 is invalid"),
    ],
)
def test_bad_recipes_are_refused_in_one_line(kwargs, message):
    with pytest.raises(UserError, match=None) as e:
        DepthDialConfig(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_recipes_refuse_adaptive_solves_and_exits():
    with pytest.raises(UserError, match="dial.random_time=True is invalid: expected false with ode.solver='heun'"):
        tiny_config(ode=OdeConfig(solver="heun"), dial=DepthDialConfig(random_time=True))
    with pytest.raises(UserError, match="adaptive solver 'tsit5'"):
        tiny_config(ode=OdeConfig(solver="tsit5"), dial=DepthDialConfig(jitter=0.5))
    with pytest.raises(UserError, match="exits='aligned'"):
        tiny_config(exits="aligned", dial=DepthDialConfig(train_steps=(2, 4)))


def test_a_dial_trained_model_is_evaluated_at_any_grid_as_without_its_recipe():
    """The recipes change training steps only: `qkvflow eval --tolerances` (qkvflow.evaluation.depth.with_ode)
    must evaluate a model trained with them at an adaptive grid too (issue 33's tsit5 curves), and give the
    logits that the same parameters give without a recipe."""
    from qkvflow.evaluation.depth import with_ode

    ode = OdeConfig(num_steps=4, solver="euler")
    config = tiny_config(ode=ode, initializer_range=0.1, time_scale=1.0)
    dialled = dataclasses.replace(config, dial=DepthDialConfig(train_steps=(2, 4, 8), jitter=0.5))
    plain, model = smooth_model(config), smooth_model(dialled)  # same key: the recipes add no parameters
    ids = random_tokens(config)
    logits = eqx.filter_jit(lambda m, x: m(x).array)
    tsit5 = OdeConfig(num_steps=4, solver="tsit5", rtol=1e-3, atol=1e-3)
    for grid in (tsit5, OdeConfig(num_steps=8, solver="heun")):
        evaluated = with_ode(model, grid)
        assert not evaluated.config.dial.active and evaluated.config.ode == grid
        np.testing.assert_array_equal(
            logits(evaluated, ids),
            logits(dataclasses.replace(plain, _config=dataclasses.replace(config, ode=grid)), ids),
        )
