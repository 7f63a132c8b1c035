import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.weight_source import WeightSource, evaluation_times, generate_batched
from qkvflow.models.diffeqformer import SharedOdeGpt2Config
from tests.helpers import tiny_config, tiny_model


@pytest.mark.parametrize(
    "solver,n,expected",
    [
        ("euler", 4, [0, 0.25, 0.5, 0.75]),
        ("heun", 2, [0, 0.5, 1.0]),
        ("rk4", 2, [0, 0.25, 0.5, 0.75, 1.0]),
        ("ralston", 1, [0, 2 / 3]),
    ],
)
def test_evaluation_times(solver, n, expected):
    np.testing.assert_allclose(evaluation_times(OdeConfig(num_steps=n, solver=solver)), expected, rtol=1e-6)


def test_adaptive_has_no_grid():
    assert evaluation_times(OdeConfig(solver="tsit5")) is None


@pytest.mark.parametrize("kind", ["hyper", "hyper_shared_mlp", "shared"])
def test_batched_generation_and_its_gradient_equal_per_step(kind):
    config = tiny_config("gpt2", ode=OdeConfig(num_steps=6), shared_time_mlp=kind == "hyper_shared_mlp")
    if kind == "shared":
        config = SharedOdeGpt2Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    model = tiny_model(config)
    times = evaluation_times(model.config.ode)
    table = generate_batched(model.generator, times)
    for k, t in enumerate(times):
        single = model.generator(t)
        for name, w in single.items():
            np.testing.assert_allclose(table[name]["ode_time", k].array, w.array, rtol=1e-6, atol=1e-7, err_msg=name)

    # The batched path has its own gradient (qkvflow.nn.projection): it must equal the per-step one.
    weights = jax.random.normal(jax.random.PRNGKey(3), (len(times),))

    def batched(generator):
        table = generate_batched(generator, times)
        return sum(jnp.sum(jnp.sin(w.array) * weights.reshape((-1,) + (1,) * (w.ndim - 1))) for w in table.values())

    def per_step(generator):
        total = 0.0
        for k, t in enumerate(times):
            total += sum(jnp.sum(jnp.sin(w.array)) * weights[k] for w in generator(t).values())
        return total

    g_batched, g_step = eqx.filter_grad(batched)(model.generator), eqx.filter_grad(per_step)(model.generator)
    for a, b in zip(jax.tree_util.tree_leaves(g_batched), jax.tree_util.tree_leaves(g_step)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree_util.tree_leaves(g_batched))


@pytest.mark.parametrize("flavour, variant", [("llama", "qkvflow"), ("gpt2", "official")])
def test_source_snaps_to_grid_and_modes_agree(flavour, variant):
    """precompute and on_the_fly give the generator's W(t) at the snapped grid time, to round-off."""
    config = tiny_config(flavour, ode=OdeConfig(num_steps=4, solver="rk4"), variant=variant, time_grid="left")
    model = tiny_model(config)
    pre = WeightSource.build(model.generator, config.ode)
    fly = WeightSource.build(model.generator, dataclasses.replace(config.ode, weight_cache="on_the_fly"))
    assert pre.table is not None and fly.table is None
    t_noisy = 0.375 + 3e-7  # what floating-point accumulation of dt gives diffrax
    a, b = pre(t_noisy), fly(t_noisy)
    exact = model.generator(0.375)
    for name in exact:
        # float32 round-off of a sum of products: ~8 eps of the array's scale
        atol = 1e-6 * float(np.abs(exact[name].array).max())
        np.testing.assert_allclose(a[name].array, exact[name].array, rtol=1e-6, atol=atol)
        np.testing.assert_allclose(b[name].array, exact[name].array, rtol=1e-6, atol=atol)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
