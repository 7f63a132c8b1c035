"""The DiffEqFormer LM: the solve is the equation it claims, for both flavours."""

import dataclasses
import json

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmExample

from qkvflow.integrate.config import OdeConfig
from tests.helpers import Vocab, random_tokens, smooth_model, tiny_config, tiny_model


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize("weight_cache", ["precompute", "on_the_fly"])
def test_euler_equals_explicit_loop(flavour, weight_cache):
    n = 5
    config = tiny_config(flavour, ode=OdeConfig(num_steps=n, weight_cache=weight_cache), initializer_range=0.2)
    model = tiny_model(config)
    ids = random_tokens(config)
    pos = hax.arange(config.max_Pos)
    x = model.embed(ids, pos)
    for k in range(n):
        w = model.generator(k / n)
        x = x + (1.0 / n) * model.field.vector_field(w, x, config=config, mask=AttentionMask.causal(), pos_ids=pos)
    solved, _, stats = model.flow(ids)
    assert int(stats.nfe) == n and int(stats.num_steps) == n
    np.testing.assert_allclose(solved.rearrange(x.axes).array, x.array, rtol=1e-5, atol=1e-5)
    # the flow really moved the state: the test would notice a solve that did nothing
    assert float(jnp.max(jnp.abs(x.array - model.embed(ids, pos).array))) > 1e-2


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_logits_are_causal(flavour):
    config = tiny_config(flavour, initializer_range=0.2)
    model = tiny_model(config)
    ids = random_tokens(config)
    i = 5
    changed = ids.at[config.max_Pos, i + 1 :].set((ids[config.max_Pos, i + 1 :] + 7) % Vocab.size)
    a, b = model(ids), model(changed)
    np.testing.assert_allclose(a[config.max_Pos, : i + 1].array, b[config.max_Pos, : i + 1].array, rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[config.max_Pos, i + 1 :].array, b[config.max_Pos, i + 1 :].array, atol=1e-4)


def _final_state(config, model, ids):
    return np.asarray(model.flow(ids)[0].array)


def test_solvers_converge_to_each_other():
    # Unit-scale embeddings and time_scale=1 keep the field smooth in x and t, so each solver's
    # order shows. (With GPT-2's 0.02 embedding init the pre-norm field has a Lipschitz constant
    # near |W| / std(x) ~ 50 at t=0, and at time_scale 1000 an untrained W(t) oscillates faster
    # than a coarse grid resolves: both hide convergence behind stiffness.)
    base = tiny_config("gpt2", initializer_range=0.1, time_scale=1.0)
    model = smooth_model(base)
    ids = random_tokens(base)

    def final(ode):
        m = dataclasses.replace(model, _config=dataclasses.replace(base, ode=ode))
        return np.asarray(m.flow(ids)[0].array)

    ref = final(OdeConfig(64, "rk4"))
    assert np.max(np.abs(final(OdeConfig(32, "rk4")) - ref)) < 1e-3

    def error(ode):
        return float(np.max(np.abs(final(ode) - ref)))

    e16, e64 = error(OdeConfig(16, "euler")), error(OdeConfig(64, "euler"))
    assert 2.5 < e16 / e64 < 6  # first order: 4x the steps, about 4x smaller error
    for solver in ("dopri5", "tsit5"):
        loose = error(OdeConfig(4, solver, rtol=1e-2, atol=1e-2))
        tight = error(OdeConfig(4, solver, rtol=1e-7, atol=1e-7))
        assert tight < loose / 10 and tight < 1e-3, (solver, loose, tight)


def test_adaptive_step_counts_vary_with_input():
    ode = OdeConfig(2, "dopri5", rtol=1e-5, atol=1e-5)
    config = tiny_config("gpt2", ode=ode, initializer_range=0.1, time_scale=1.0)
    model = smooth_model(config)
    num_steps = eqx.filter_jit(lambda m, ids: m.flow(ids)[2].num_steps)  # one program for the six inputs
    counts = {int(num_steps(model, random_tokens(config, seed=s))) for s in range(6)}
    assert len(counts) > 1, counts


def _grads(model, ids):
    example = LmExample.causal(ids["batch", 0])

    def loss(m):
        return m.compute_next_token_loss(example).scalar()

    return eqx.filter_jit(eqx.filter_grad(loss))(model)  # compiled once: op by op, a solve's grad is ~1.5x slower


@pytest.mark.parametrize("other", ["direct", "backsolve"])
def test_gradients_match_across_adjoints(other):
    solver = "euler" if other == "direct" else "dopri5"
    ode = OdeConfig(4, solver, rtol=1e-6, atol=1e-6)
    config = tiny_config("gpt2", ode=ode, initializer_range=0.1, time_scale=1.0)
    model = smooth_model(config)
    ids = random_tokens(config)
    ref = _grads(model, ids)
    alt_model = dataclasses.replace(
        model, _config=dataclasses.replace(config, ode=dataclasses.replace(ode, adjoint=other))
    )
    alt = _grads(alt_model, ids)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(ref))
    assert _relative_difference(ref, alt) < (1e-5 if other == "direct" else 1e-3)


def _relative_difference(g1, g2) -> float:
    a = jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(g1)])
    b = jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(g2)])
    assert float(jnp.linalg.norm(a)) > 0
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))


def test_recursive_checkpoint_with_few_checkpoints_gives_same_gradients():
    config = tiny_config("llama", ode=OdeConfig(8, checkpoints=2), initializer_range=0.2)
    model = tiny_model(config)
    ids = random_tokens(config)
    full = dataclasses.replace(model, _config=dataclasses.replace(config, ode=OdeConfig(8)))
    assert _relative_difference(_grads(model, ids), _grads(full, ids)) < 1e-5


def test_kinetic_energy_is_integral_of_squared_speed():
    from qkvflow.training.loss import lm_loss

    n = 4
    config = tiny_config("gpt2", ode=OdeConfig(n), kinetic_weight=0.5, initializer_range=0.2)
    model = tiny_model(config)
    ids = random_tokens(config)
    pos = hax.arange(config.max_Pos)
    x, energy = model.embed(ids, pos), 0.0
    tokens = x.size // config.hidden_dim
    for k in range(n):
        dx = model.field.vector_field(
            model.generator(k / n), x, config=config, mask=AttentionMask.causal(), pos_ids=pos
        )
        energy += float(jnp.sum(dx.array**2)) / tokens / n
        x = x + dx / n
    _, solved_energy, _ = model.flow(ids)
    np.testing.assert_allclose(float(solved_energy), energy, rtol=1e-4)
    assert energy > 0
    # the training loss adds lambda/2 * E; the plain LM loss (what evaluation sees) does not
    example = LmExample.causal(ids["batch", 0])
    with_penalty, metrics = lm_loss(model, example)
    plain = model.compute_next_token_loss(example).scalar()
    _, energy0, _ = model.flow(example.tokens)
    np.testing.assert_allclose(float(with_penalty), float(plain) + 0.25 * float(energy0), rtol=1e-5)
    assert float(metrics["ode_nfe"].value()) == n


def _reference_loss(logits, ids, weight, z=0.0) -> float:
    """Weighted mean over positions of -log p(next token) + z * logsumexp^2, in float64 from the logits."""
    logits = np.asarray(logits.rearrange(("position", "vocab")).array, np.float64)
    log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    tokens = np.asarray(ids.array)
    nll = log_z[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]] + z * log_z[:-1] ** 2
    w = np.asarray(weight, np.float64)[:-1]
    return float(np.sum(w * nll) / np.sum(w))


@pytest.mark.parametrize("kind", ["diffeqformer_gpt2", "gpt2"])
def test_lm_loss_is_the_weighted_cross_entropy_whatever_the_weights_dtype(kind):
    """qkvflow.training.loss.lm_loss against the formula, for a DiffEqFormer and for Levanter's GPT-2 (which it
    hands to Levanter), with z-loss and a weight that drops positions and counts one twice, given as
    floats and as integers (marin-levanter takes the loss's dtype from the weight: an int weight must be
    cast, or the loss comes out as a wrong integer)."""
    import jax.random as jrandom
    from levanter.models.gpt2 import Gpt2Config

    from qkvflow.training.loss import lm_loss

    config = tiny_config("gpt2", initializer_range=0.2)
    if kind == "gpt2":
        gpt2 = Gpt2Config(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=1, initializer_range=0.2)
        model = gpt2.build(Vocab, key=jrandom.PRNGKey(0))
    else:
        model = tiny_model(config)
    ids = random_tokens(config)["batch", 0]
    weight, z = np.array([0, 0, 1, 1, 1, 2, 1, 1, 0, 1, 1, 1]), 1e-2
    reference = _reference_loss(eqx.filter_jit(model)(ids, AttentionMask.causal()), ids, weight, z)
    unweighted = _reference_loss(model(ids, AttentionMask.causal()), ids, np.ones(12), z)
    assert abs(reference - unweighted) > 10 * 1e-5 * reference  # a loss that ignored the weight would fail
    loss_fn = eqx.filter_jit(lm_loss)  # one compilation per weight dtype
    causal = LmExample.causal(ids)
    for dtype in (jnp.float32, jnp.int32):
        example = LmExample(ids, (causal.loss_weight * hax.named(weight, ids.axes)).astype(dtype), causal.attn_mask)
        out = loss_fn(model, example, z_loss_weight=z)
        loss = out[0] if isinstance(out, tuple) else out
        assert jnp.issubdtype(jnp.asarray(loss).dtype, jnp.floating)
        np.testing.assert_allclose(float(loss), reference, rtol=1e-5, err_msg=str(dtype))


def test_shared_generator_is_constant_plus_linear_bias():
    from qkvflow.models.diffeqformer import SharedOdeLlamaConfig

    config = SharedOdeLlamaConfig(max_seq_len=8, hidden_dim=16, num_heads=2, ode=OdeConfig(3))
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    gen = model.generator
    gen = dataclasses.replace(gen, time_bias={k: v + 1.0 for k, v in gen.time_bias.items()})
    w0, w1 = gen(0.0), gen(0.5)
    np.testing.assert_array_equal(w0["q"].array, w1["q"].array)
    np.testing.assert_allclose(w1["q_bias"].array - w0["q_bias"].array, 0.5)
    assert "w_down_bias" in w0  # every affine map gets its time bias, even in the bias-free Llama field
    logits = model(random_tokens(config))
    assert bool(jnp.all(jnp.isfinite(logits.array)))


@pytest.mark.parametrize("generator", ["diffeqformer_gpt2", "shared_ode_gpt2"])
def test_matrix_init_fan_in_matches_levanter_linear(generator):
    """matrix_init fan_in: generated matrices start with std 1/sqrt(fan_in), as haliax's Linear (and so
    Levanter's GPT-2 baseline) does; "normal" keeps initializer_range."""
    from levanter.models.lm_model import LmConfig

    cls = LmConfig.get_choice_class(generator)
    base = dict(max_seq_len=12, hidden_dim=64, num_heads=4, time_embed_dim=16, num_frequencies=16)
    for init, q_std, w2_std in (("fan_in", 64**-0.5, 256**-0.5), ("normal", 0.02, 0.02)):
        model = tiny_model(cls(matrix_init=init, **base))
        ws = [model.generator(t) for t in np.linspace(0.0, 1.0, 9)]  # the init normalises over these times
        rms = {n: np.sqrt(np.mean([np.mean(np.square(np.asarray(w[n].array))) for w in ws])) for n in ("q", "w2")}
        assert rms["q"] == pytest.approx(q_std, rel=0.2) and rms["w2"] == pytest.approx(w2_std, rel=0.2)


def test_matrix_init_rejects_unknown_value():
    from qkvflow.errors import ConfigError

    with pytest.raises(ConfigError, match="matrix_init='xavier' is invalid"):
        tiny_config("gpt2", matrix_init="xavier")


def test_ode_export_keeps_the_opt_in_knobs(tmp_path):
    """time_embed_norm and matrix_init travel in the ODE export's config, so the reloaded model
    computes the same logits (a loader that dropped time_embed_norm would not)."""
    from qkvflow.export.ode import load_ode_export, save_ode_export

    config = tiny_config("gpt2", time_embed_norm=True, matrix_init="fan_in")
    model = tiny_model(config)
    save_ode_export(model, str(tmp_path))
    loaded = load_ode_export(str(tmp_path))
    assert loaded.config.time_embed_norm and loaded.config.matrix_init == "fan_in"
    ids = random_tokens(config)
    logits = lambda m: np.asarray(m(ids, attn_mask=AttentionMask.causal()).array)  # noqa: E731
    np.testing.assert_array_equal(logits(loaded), logits(model))
    # Negative control: the same weights read back with time_embed_norm off compute something else.
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["model"]["time_embed_norm"] = False
    (tmp_path / "config.json").write_text(json.dumps(meta))
    assert not np.allclose(logits(load_ode_export(str(tmp_path))), logits(model), rtol=1e-3, atol=0)


def test_a_fixed_grid_compiles_without_host_callbacks_so_jax_can_cache_it():
    """JAX never writes a program with a host callback to its persistent compilation cache, so every
    run and every restart compiled the training step again. diffrax's failure check (`throw=True`)
    is such a callback; a fixed grid cannot fail (it takes exactly N steps to t = 1), so qkvflow turns
    the check off there and keeps it for adaptive solves, whose `max_steps` can run out."""

    def has_callback(ode):
        model = tiny_model(tiny_config("gpt2", ode=ode))
        ids = random_tokens(model.config)
        loss = lambda m: m(ids).array.sum()  # noqa: E731
        return "callback" in eqx.filter_jit(eqx.filter_grad(loss)).lower(model).as_text()

    assert not has_callback(OdeConfig(num_steps=3, solver="heun"))
    assert has_callback(OdeConfig(num_steps=3, solver="tsit5", adaptive=True))  # the check can be seen


def test_a_model_run_outside_jit_compiles_its_solve_once():
    """Called outside `jit` (a notebook, an analysis), the model's solve is diffrax's own compiled
    `diffeqsolve`, cached on its arguments' structure: the field must reach it as a module whose
    parameters are inputs (`RawField`, `WithEnergy`), not as a new closure per call, which compiled the
    solve afresh every call (~3.5 s each for this tiny model)."""
    import jax.monitoring

    model = tiny_model(tiny_config("gpt2", ode=OdeConfig(num_steps=3, solver="heun"), kinetic_weight=0.5))
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    model.flow(random_tokens(model.config, seed=1))  # compiles the solve and every eager op once
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        model.flow(random_tokens(model.config, seed=2))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


@pytest.mark.parametrize("n", [1, 3, 7, 10, 33, 64, 100])
def test_a_fixed_grid_reaches_t_equals_1_in_n_steps(n):
    """What the dropped failure check would have caught: float32 step sizes 1/N that stop short of
    t = 1. dx/dt = 1 from x(0) = 0 by Euler must give x(1) = 1 up to N additions' round-off (a grid
    one step short would give 1 - 1/N)."""
    from qkvflow.integrate.solve import integrate

    y1, _, stats = integrate(lambda t, y, args: jnp.ones_like(y), jnp.zeros(()), None, OdeConfig(num_steps=n))
    assert int(stats.num_steps) == n
    assert abs(float(y1) - 1.0) <= n * float(np.finfo(np.float32).eps)
