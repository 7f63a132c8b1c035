"""A fixed-step explicit Runge-Kutta solve of dx/dt = F(W(t), x) over [0, 1] as a stack of layers.

With N steps of size h = 1/N and the solver's Butcher tableau (a, b, c) (Euler: a = [], b = (1,),
c = (0,)), step n computes, for stages i = 1..s,

    t_{n,i} = (n + c_i) / N,   x_{n,i} = x_n + sum_{j<i} a_ij k_j,   k_i = h F(W(t_{n,i}), x_{n,i}),
    x_{n+1} = x_n + sum_i b_i k_i,

which is diffrax's arithmetic for an explicit RK method with a constant step (diffrax
`AbstractRungeKutta.step`: increments k_i = h F, the same tableau). Each stage's F attends over the
stage states x_{n,i} of all earlier tokens, so caching the keys and values of x_{n,i} per stage
(N * s caches) gives exact incremental decoding, as a transformer caches per layer.

diffrax runs the stages inside `lax.scan`, so its step cannot carry per-stage caches; `Stage`s are
built here from the tableau of the same diffrax solver object (`qkvflow.integrate.solve.build_solver`).
An adaptive solve has no fixed times: `schedule` refuses it.
"""

from typing import NamedTuple

import numpy as np

from qkvflow.errors import UserError
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import build_solver
from qkvflow.integrate.weight_source import evaluation_times


class Stage(NamedTuple):
    """One stage of one explicit Runge-Kutta step: which weight-table time it evaluates at, and how it
    combines the step's earlier increments."""

    time_index: int
    """Index of t_{n,i} in `evaluation_times(config)` (the rows of the weight table)."""
    a: tuple[float, ...]
    """a_ij for j < i: how the stage state combines the step's earlier increments."""


class Schedule(NamedTuple):
    """A fixed-step solve laid out as layers: step size h, the stages of every step, and the weights b
    of the step's final combination x + h sum_i b_i k_i."""

    h: float
    stages: tuple[tuple[Stage, ...], ...]
    """`stages[n][i]`: step n, stage i."""
    b: tuple[float, ...]

    @property
    def num_layers(self) -> int:
        return sum(len(step) for step in self.stages)


def tableau(solver) -> tuple[list[tuple[float, ...]], tuple[float, ...], tuple[float, ...]]:
    """(a rows, b, c) of a diffrax explicit RK solver; Euler (no tableau) is the one-stage method."""
    tab = getattr(solver, "tableau", None)
    if tab is None:
        return [()], (1.0,), (0.0,)
    a = [()] + [tuple(float(v) for v in row) for row in tab.a_lower]
    return a, tuple(float(v) for v in tab.b_sol), (0.0, *(float(v) for v in tab.c))


def schedule(ode: OdeConfig) -> Schedule:
    if ode.is_adaptive:
        raise UserError(
            f"model.ode.solver={ode.solver} is adaptive: KV-cached decoding needs a fixed-step solver; "
            f"pass --model.ode.adaptive false (fixed steps of {ode.solver}) or --model.ode.solver euler, with --steps N"
        )
    a, b, c = tableau(build_solver(ode))
    times = evaluation_times(ode)
    n = ode.num_steps
    steps = []
    for k in range(n):
        stage_times = [round((k + ci) / n, 12) for ci in c]
        index = [int(np.argmin(np.abs(times.astype(np.float64) - t))) for t in stage_times]
        steps.append(tuple(Stage(i, row) for i, row in zip(index, a)))
    return Schedule(1.0 / n, tuple(steps), b)
