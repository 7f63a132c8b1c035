"""`loop: scan` against diffrax's own fixed-step solve: the same numbers to round-off, forward and
gradient, for each fixed-step solver, with the kinetic energy, and in the DiffEqFormer.

The reference is `diffrax.diffeqsolve` with `ConstantStepSize` (what `loop: diffrax` runs), called here
directly. A nonlinear field with parameters in `args` makes the gradient through args nontrivial:

    dy/dt = tanh(A y + b t)
"""

import dataclasses

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import integrate
from qkvflow.integrate.solvers import SOLVERS
from tests.helpers import random_tokens, tiny_config, tiny_model

F32 = np.finfo(np.float32).eps


def field(t, y, args):
    a, b = args
    return jnp.tanh(a @ y + b * t)


def problem():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    a = jax.random.normal(k1, (6, 6)) / 2
    b = jax.random.normal(k2, (6,))
    return jax.random.normal(k3, (6,)), (a, b)


def diffrax_solve(solver, n, y0, args):
    sol = dfx.diffeqsolve(
        dfx.ODETerm(field),
        SOLVERS[solver](),
        0.0,
        1.0,
        1.0 / n,
        y0,
        args,
        stepsize_controller=dfx.ConstantStepSize(),
        adjoint=dfx.RecursiveCheckpointAdjoint(checkpoints=n),
        max_steps=n,
    )
    return sol.ys[-1]


@pytest.mark.parametrize("solver", ["euler", "heun", "rk4", "tsit5"])
def test_scan_equals_diffrax_forward_and_gradient(solver):
    n = 5
    y0, args = problem()
    config = OdeConfig(num_steps=n, solver=solver, adaptive=False if solver == "tsit5" else None, loop="scan")

    def scanned(y0, args):
        return jnp.sum(jnp.sin(integrate(field, y0, args, config)[0]))

    def reference(y0, args):
        return jnp.sum(jnp.sin(diffrax_solve(solver, n, y0, args)))

    y_scan = jax.jit(lambda y0, args: integrate(field, y0, args, config)[0])(y0, args)
    y_ref = jax.jit(lambda y0, args: diffrax_solve(solver, n, y0, args))(y0, args)
    np.testing.assert_allclose(y_scan, y_ref, rtol=8 * F32, atol=8 * F32)
    g_scan = jax.jit(jax.grad(scanned, argnums=(0, 1)))(y0, args)
    g_ref = jax.jit(jax.grad(reference, argnums=(0, 1)))(y0, args)
    for a, b in zip(jax.tree_util.tree_leaves(g_scan), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=32 * F32, atol=32 * F32)


def test_scan_counts_and_kinetic_energy_as_diffrax():
    y0, args = problem()
    base = OdeConfig(num_steps=4, solver="rk4")
    y_ref, e_ref, s_ref = jax.jit(lambda y0, args: integrate(field, y0, args, base, tokens=2))(y0, args)
    scan = dataclasses.replace(base, loop="scan")
    y_scan, e_scan, s_scan = jax.jit(lambda y0, args: integrate(field, y0, args, scan, tokens=2))(y0, args)
    np.testing.assert_allclose(y_scan, y_ref, rtol=8 * F32, atol=8 * F32)
    np.testing.assert_allclose(e_scan, e_ref, rtol=8 * F32)
    assert int(s_scan.num_steps) == int(s_ref.num_steps) == 4 and int(s_scan.nfe) == int(s_ref.nfe) == 16


def test_a_bf16_start_is_solved_in_f32_as_diffrax_does():
    """diffeqsolve solves a bf16 y0 as a state in the promotion of its dtype and the time's (f32); the
    scan does the same, step by step, instead of rounding each step's state to bf16."""

    def bf16_field(t, y, args):  # a bf16 field, as the DiffEqFormer's under a bf16 policy
        return field(t, y.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), args))

    y0, args = problem()
    y0 = y0.astype(jnp.bfloat16)
    config = OdeConfig(num_steps=6, loop="scan")
    y_scan = jax.jit(lambda y0, args: integrate(bf16_field, y0, args, config)[0])(y0, args)
    y_ref = jax.jit(
        lambda y0, args: dfx.diffeqsolve(
            dfx.ODETerm(bf16_field), dfx.Euler(), 0.0, 1.0, 1 / 6, y0, args, max_steps=6
        ).ys[-1]
    )(y0, args)
    assert y_scan.dtype == y_ref.dtype == jnp.float32
    np.testing.assert_allclose(y_scan, y_ref, rtol=8 * F32, atol=8 * F32)


def test_diffeqformer_loss_and_gradient_are_the_same_with_the_scan():
    """The model's training loss and its gradient with respect to every parameter, loop scan against
    diffrax: float32 round-off of the same products (the scan's XLA program fuses them differently)."""
    import haliax as hax
    from levanter.models.lm_model import LmExample

    from qkvflow.training.loss import lm_loss
    from tests.helpers import Batch

    config = tiny_config("gpt2", ode=OdeConfig(num_steps=3))
    model = tiny_model(config)
    example = hax.vmap(LmExample.causal, Batch)(random_tokens(config))

    def loss(model):
        out = lm_loss(model, example)
        out = out[0] if isinstance(out, tuple) else out
        return out.scalar() if isinstance(out, hax.NamedArray) else out

    scan_config = dataclasses.replace(config, ode=dataclasses.replace(config.ode, loop="scan"))
    scan_model = dataclasses.replace(model, _config=scan_config)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    l_ref, g_ref = value_and_grad(model)
    l_scan, g_scan = value_and_grad(scan_model)
    np.testing.assert_allclose(l_scan, l_ref, rtol=16 * F32)
    # each leaf to 1e-4 of its own scale; a leaf whose gradient cancels to round-off (~1e-14 for biases a
    # norm removes) to the round-off of the terms that cancel, of the size of the largest gradient
    leaves = list(zip(jax.tree_util.tree_leaves(g_scan), jax.tree_util.tree_leaves(g_ref)))
    largest = max(float(jnp.max(jnp.abs(b))) for _, b in leaves)
    for a, b in leaves:
        atol = max(1e-4 * float(jnp.max(jnp.abs(b))), 64 * F32 * largest)
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "kwargs",
    [dict(solver="dopri5"), dict(adjoint="direct"), dict(checkpoints=2)],
)
def test_scan_refuses_what_it_does_not_compute(kwargs):
    with pytest.raises(ValueError, match=r"ode\.loop") as err:
        OdeConfig(num_steps=4, loop="scan", **kwargs)
    assert "expected" in str(err.value)
