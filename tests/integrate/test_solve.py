"""`integrate` on a scalar ODE with a known solution: each fixed-step solver has its order, counts its
evaluations, and the kinetic energy is the integral it claims.

    dy/dt = y cos(t),  y(0) = 1   =>   y(t) = exp(sin t)
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import integrate

EXACT = math.exp(math.sin(1.0))
ORDER = {"euler": 1, "heun": 2, "midpoint": 2, "ralston": 2, "rk4": 4}
STAGES = {"euler": 1, "heun": 2, "midpoint": 2, "ralston": 2, "rk4": 4}


def field(t, y, args):
    return y * jnp.cos(t)


def solve(solver, n, **kwargs):
    y1, energy, stats = integrate(
        field, jnp.ones((), jnp.float64), None, OdeConfig(num_steps=n, solver=solver), **kwargs
    )
    return y1, energy, stats


@pytest.fixture(autouse=True)
def float64():
    import jax

    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("solver", list(ORDER))
def test_fixed_step_solvers_have_their_order_and_cost(solver):
    errors = []
    for n in (8, 16):
        y1, _, stats = solve(solver, n)
        errors.append(abs(float(y1) - EXACT))
        assert int(stats.num_steps) == n and int(stats.nfe) == n * STAGES[solver]
    observed = math.log2(errors[0] / errors[1])
    assert abs(observed - ORDER[solver]) < 0.3, (solver, errors, observed)


def test_kinetic_energy_is_the_integral_of_the_squared_speed():
    # one "token": E = int_0^1 (y cos t)^2 dt = int_0^1 exp(2 sin t) cos(t)^2 dt, by fine quadrature here
    t = np.linspace(0.0, 1.0, 200_001)
    integrand = np.exp(2 * np.sin(t)) * np.cos(t) ** 2
    exact = float(np.sum((integrand[1:] + integrand[:-1]) / 2) * (t[1] - t[0]))
    _, energy, _ = solve("rk4", 64, tokens=1)
    # the energy rate is accumulated in float32 (qkvflow.integrate.solve): a few ulps of float32
    np.testing.assert_allclose(float(energy), exact, rtol=8 * np.finfo(np.float32).eps)


def test_kinetic_energy_is_the_mean_over_tokens():
    """Two token states y0 = (1, 2) of the same ODE: the rate is the squared speed summed over tokens
    and divided by their number, so E = (1 + 4) / 2 times the one-token integral above."""
    t = np.linspace(0.0, 1.0, 200_001)
    integrand = np.exp(2 * np.sin(t)) * np.cos(t) ** 2
    one_token = float(np.sum((integrand[1:] + integrand[:-1]) / 2) * (t[1] - t[0]))
    y0 = jnp.array([1.0, 2.0], jnp.float64)
    _, energy, _ = integrate(field, y0, None, OdeConfig(num_steps=64, solver="rk4"), tokens=2)
    np.testing.assert_allclose(float(energy), 2.5 * one_token, rtol=8 * np.finfo(np.float32).eps)


@pytest.mark.parametrize("solver, tol", [("tsit5", 1e-9), ("dopri5", 1e-9), ("heun", 1e-6)])
def test_adaptive_solves_count_every_evaluation_the_solver_made(solver, tol):
    """`stats.nfe` against a counter the field itself bumps at run time (a host callback), over an
    adaptive solve whose first step (dt0 = 1/2) is too long, so that it is rejected before one is
    accepted: first-same-as-last methods (Tsit5, Dopri5: 7 stages) then evaluate f(t0, y0) again at
    each attempt, more than 1 + steps x 6; Heun pays 2 per step, rejected or not."""
    import jax

    calls = []

    def counted(t, y, args):
        jax.debug.callback(lambda: calls.append(1))
        return field(t, y, args)

    config = OdeConfig(num_steps=2, solver=solver, adaptive=True, rtol=tol, atol=tol, max_steps=4096)
    y1, _, stats = integrate(counted, jnp.ones((), jnp.float64), None, config)
    jax.block_until_ready(y1)
    steps = int(stats.num_steps)
    assert int(stats.nfe) == len(calls)
    if solver == "heun":
        assert len(calls) == 2 * steps
    else:
        assert len(calls) > 1 + 6 * steps  # the scenario this test is for: a rejected first step
    assert abs(float(y1) - EXACT) < 100 * tol


def _one_step_by_hand(solver: str, h: float = 1.0, y0: float = 1.0) -> float:
    """One step of each method from its textbook formula (Butcher, "Numerical Methods for ODEs", 2016)."""

    def f(t, y):
        return y * math.cos(t)

    k1 = f(0.0, y0)
    if solver == "euler":
        return y0 + h * k1
    if solver == "heun":  # trapezoidal predictor-corrector
        k2 = f(h, y0 + h * k1)
        return y0 + h * (k1 + k2) / 2
    if solver == "midpoint":
        return y0 + h * f(h / 2, y0 + h / 2 * k1)
    if solver == "ralston":  # minimum-error second-order method
        k2 = f(2 * h / 3, y0 + 2 * h / 3 * k1)
        return y0 + h * (k1 / 4 + 3 * k2 / 4)
    k2 = f(h / 2, y0 + h / 2 * k1)  # classical RK4
    k3 = f(h / 2, y0 + h / 2 * k2)
    k4 = f(h, y0 + h * k3)
    return y0 + h * (k1 + 2 * k2 + 2 * k3 + k4) / 6


@pytest.mark.parametrize("solver", list(ORDER))
def test_one_step_is_the_methods_own_formula(solver):
    """Methods of the same order share a convergence rate but not their step: one step of h = 1 equals
    the method's formula to float64 round-off (a few ulp of the O(1) result)."""
    y1, _, _ = solve(solver, 1)
    assert float(y1) == pytest.approx(_one_step_by_hand(solver), rel=8 * np.finfo(np.float64).eps, abs=0)
