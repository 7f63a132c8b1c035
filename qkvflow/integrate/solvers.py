"""The solvers qkvflow offers, by name, and what each costs per step.

All are diffrax explicit Runge-Kutta methods. diffrax ships no classical fourth-order method, so
`RK4` below supplies its Butcher tableau (Kutta, 1901): c = (0, 1/2, 1/2, 1), b = (1/6, 1/3, 1/3, 1/6).
"""

from typing import Callable, ClassVar

import diffrax as dfx
import jax.numpy as jnp
import numpy as np

_rk4_tableau = dfx.ButcherTableau(
    a_lower=(np.array([0.5]), np.array([0.0, 0.5]), np.array([0.0, 0.0, 1.0])),
    b_sol=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
    # No embedded lower-order solution exists; a zero error estimate makes RK4 fixed-step only.
    b_error=np.zeros(4),
    c=np.array([0.5, 0.5, 1.0]),
)


class RK4(dfx.AbstractERK):
    """Classical 4th-order Runge-Kutta method (4 stages, fixed steps only)."""

    tableau: ClassVar[dfx.ButcherTableau] = _rk4_tableau
    interpolation_cls: ClassVar = dfx.ThirdOrderHermitePolynomialInterpolation.from_k

    def order(self, terms):
        return 4


SOLVERS: dict[str, type[dfx.AbstractSolver]] = {
    "euler": dfx.Euler,
    "heun": dfx.Heun,
    "midpoint": dfx.Midpoint,
    "ralston": dfx.Ralston,
    "rk4": RK4,
    "tsit5": dfx.Tsit5,
    "dopri5": dfx.Dopri5,
}

# Solvers with an embedded error estimate, which an adaptive step-size controller needs.
EMBEDDED_ERROR = frozenset({"heun", "midpoint", "ralston", "tsit5", "dopri5"})
# Solvers that are adaptive unless the config says otherwise.
ADAPTIVE_BY_DEFAULT = frozenset({"tsit5", "dopri5"})


def stage_offsets(solver: dfx.AbstractSolver) -> tuple[float, ...]:
    """Fractions of a step at which `solver` evaluates the vector field: (0, c_2, ..., c_s)."""
    tableau = getattr(solver, "tableau", None)
    if tableau is None:  # Euler
        return (0.0,)
    return (0.0, *(float(c) for c in tableau.c))


def evaluations(solver: dfx.AbstractSolver, num_steps, leading_rejections=0):
    """Vector-field evaluations used by `num_steps` steps (accepted and rejected alike).

    First-same-as-last methods (Tsit5, Dopri5) reuse the last stage of a step as the first of the
    next, so they pay one fewer evaluation per step, plus the first stage of every attempt at the
    first step: 1 + `leading_rejections` (rejected attempts before the first accepted step, which
    `CountingController` records; diffrax re-evaluates f(t0, y0) until a step is accepted).
    """
    tableau = getattr(solver, "tableau", None)
    if tableau is None:
        return num_steps
    stages = len(tableau.b_sol)
    if tableau.fsal:
        return 1 + leading_rejections + num_steps * (stages - 1)
    return num_steps * stages


class CountingController(dfx.AbstractAdaptiveStepSizeController):
    """`inner` (a PIDController), also counting the rejected attempts before the first accepted step.

    diffrax's statistics give accepted and rejected steps, but not when a rejection happened; a
    first-same-as-last solver pays one more evaluation for each rejection of its first step (see
    `evaluations`). The controller's state, unlike the solver's, survives rejected steps, so it can
    keep the count: state = (inner state, a step was accepted, leading rejections).
    """

    inner: dfx.PIDController
    rtol: float
    atol: float
    norm: Callable

    def __init__(self, inner: dfx.PIDController):
        self.inner = inner
        self.rtol, self.atol, self.norm = inner.rtol, inner.atol, inner.norm

    def wrap(self, direction):
        return CountingController(self.inner.wrap(direction))

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        tnext, state = self.inner.init(terms, t0, t1, y0, dt0, args, func, error_order)
        return tnext, (state, jnp.asarray(False), jnp.asarray(0, jnp.int32))

    def adapt_step_size(self, t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state):
        state, accepted, leading = controller_state
        keep, next_t0, next_t1, made_jump, state, result = self.inner.adapt_step_size(
            t0, t1, y0, y1_candidate, args, y_error, error_order, state
        )
        leading = leading + jnp.where(accepted | keep, 0, 1).astype(jnp.int32)
        return keep, next_t0, next_t1, made_jump, (state, accepted | keep, leading), result
