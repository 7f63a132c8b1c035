"""Integrate dx/dt = F(W(t), x) over depth time t in [0, 1] with diffrax.

diffrax's internal arithmetic works on raw arrays, so the state travels as a plain array and the
caller's vector field re-wraps it in named axes. Everything the field depends on (the weight
source, masks) goes through `args`, which every diffrax adjoint, BacksolveAdjoint included,
differentiates.

With `kinetic=True` the state is augmented with the running kinetic energy

    E(t) = int_0^t mean_tokens ||dx/ds||^2 ds,

the arclength regulariser of the N-ODE Transformer (Baier-Reinio & De Sterck, 2020, eq. 6).
"""

from typing import Callable, NamedTuple, Optional

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp

from .config import OdeConfig
from .scan import scan_solve
from .solvers import SOLVERS, CountingController, evaluations


class OdeStats(NamedTuple):
    """What a solve cost, from diffrax's statistics (per call, so per batch when the batch is solved
    as one state)."""

    num_steps: jax.Array
    """Steps taken, rejected ones included."""
    nfe: jax.Array
    """Vector-field evaluations in the forward solve: the model's effective depth."""


def build_solver(config: OdeConfig) -> dfx.AbstractSolver:
    """The diffrax solver named by `config.solver` (see `qkvflow.integrate.solvers.SOLVERS`)."""
    return SOLVERS[config.solver]()


def build_adjoint(config: OdeConfig) -> dfx.AbstractAdjoint:
    """The diffrax adjoint for `config.adjoint`: discretise-then-optimise with checkpoints
    (`RecursiveCheckpointAdjoint`, K = `checkpoints`, or every step of a fixed grid), `DirectAdjoint`,
    or the continuous adjoint (`BacksolveAdjoint`, Chen et al. 2018) with the forward solver."""
    if config.adjoint == "recursive_checkpoint":
        checkpoints = config.checkpoints
        if checkpoints is None and not config.is_adaptive:
            checkpoints = config.num_steps  # store every step's state, as per-layer remat does
        return dfx.RecursiveCheckpointAdjoint(checkpoints=checkpoints)
    if config.adjoint == "direct":
        return dfx.DirectAdjoint()
    return dfx.BacksolveAdjoint(solver=build_solver(config))


class WithEnergy(eqx.Module):
    """The field augmented with the kinetic energy's rate, (y, E) -> (f(t, y), |f(t, y)|^2 / tokens): a
    module, so that a field that is one (its parameters inputs of the compiled solve) stays one."""

    field: Callable
    tokens: int = eqx.field(static=True)

    def __call__(self, t, state, args):
        dy = self.field(t, state[0], args)
        return dy, jnp.sum(jnp.square(dy.astype(jnp.float32))) / self.tokens


def integrate(
    field: Callable,
    y0: jax.Array,
    args,
    config: OdeConfig,
    *,
    tokens: Optional[int] = None,
    norm: Optional[Callable] = None,
    ts: Optional[jax.Array] = None,
    grid: Optional[jax.Array] = None,
) -> tuple[jax.Array, Optional[jax.Array], OdeStats]:
    """Solve from t=0 to t=1; return (x(1), kinetic energy or None, stats).

    `field(t, y, args) -> dy/dt` with y shaped like y0. Pass `tokens` (the number of token states
    in y0) to integrate the kinetic energy alongside. `norm` is the adaptive controller's error norm
    (diffrax's `PIDController(norm=)`, given the scaled error shaped like the state: y0's array, or
    (array, energy) with `tokens`); None: diffrax's RMS over every element. With `ts` (increasing times
    in (0, 1], the last one 1) the first result is x at every time of `ts`, stacked on a leading axis
    (diffrax's `SaveAt(ts=...)`), and the energy is the one at the last time. With `grid` (config.num_steps
    + 1 increasing times from 0, a fixed-step solver) the steps go from one time of `grid` to the next
    (diffrax's `StepTo`) and the solve ends at grid[-1] (`qkvflow.models.depth_dial`). `config.loop ==
    "scan"` solves a fixed grid by `qkvflow.integrate.scan` (diffrax's solve when `ts` is given).
    """
    solver = build_solver(config)
    dt0, t1 = 1.0 / config.num_steps, 1.0

    if tokens is None:
        term_fn, state0 = field, y0
    else:
        term_fn, state0 = WithEnergy(field, tokens), (y0, jnp.zeros((), jnp.float32))

    if config.loop == "scan" and ts is None:
        final = scan_solve(term_fn, solver, state0, args, config.num_steps, times=grid)
        steps = jnp.asarray(config.num_steps, jnp.int32)
        stats = OdeStats(num_steps=steps, nfe=evaluations(solver, steps))
        return (final, None, stats) if tokens is None else (final[0], final[1], stats)

    if config.is_adaptive:
        norm_kw = {} if norm is None else {"norm": norm}
        controller = CountingController(dfx.PIDController(rtol=config.rtol, atol=config.atol, **norm_kw))
        max_steps = config.max_steps
    elif grid is None:
        controller = dfx.ConstantStepSize()
        max_steps = config.num_steps
    else:
        controller, dt0, t1 = dfx.StepTo(ts=grid), None, grid[-1]
        max_steps = config.num_steps

    if ts is None:
        saveat = dfx.SaveAt(t1=True, controller_state=config.is_adaptive)
    else:
        saveat = dfx.SaveAt(ts=ts, controller_state=config.is_adaptive)
    solution = dfx.diffeqsolve(
        dfx.ODETerm(term_fn),
        solver,
        t0=0.0,
        t1=t1,
        dt0=dt0,
        y0=state0,
        args=args,
        saveat=saveat,
        stepsize_controller=controller,
        adjoint=build_adjoint(config),
        max_steps=max_steps,
        # diffrax's failure check is a host callback, and JAX never caches a program that has one: with
        # it every run compiled its training step afresh. A fixed grid cannot fail (N steps reach t = 1).
        throw=config.is_adaptive,
    )
    final = solution.ys if ts is not None else jax.tree_util.tree_map(lambda a: a[-1], solution.ys)
    num_steps = solution.stats["num_steps"]
    leading = solution.controller_state[2] if config.is_adaptive else 0
    stats = OdeStats(num_steps=num_steps, nfe=evaluations(solver, num_steps, leading))
    if tokens is None:
        return final, None, stats
    energy = final[1] if ts is None else final[1][-1]
    return final[0], energy, stats
