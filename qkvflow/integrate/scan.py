"""A fixed-step solve as a `lax.scan` over diffrax's own solver step, rematerialised per step.

    t_k = k / N,   y_{k+1} = solver.step(F, t_k, t_{k+1}, y_k)      k = 0 .. N-1

This is what `diffeqsolve` computes with `ConstantStepSize` and `RecursiveCheckpointAdjoint` keeping
every step's state: the same solver step (`AbstractSolver.step`, diffrax's public interface), the same
times (diffrax 0.7's constant controller places t_k = t0 + (t1 - t0) * k / N and ends exactly at t1),
and a backward pass that stores y_k and recomputes step k's inside once, as a transformer's per-layer
gradient checkpointing does. The difference is the loop: a scan of N identical steps, the way Levanter
scans a stack of layers, instead of diffrax's while loop with its controller, saving and event logic,
and equinox's checkpointed while loop for the backward pass. `OdeConfig(loop="scan")` selects it.
"""

from typing import Callable

import diffrax as dfx
import jax
import jax.numpy as jnp


def scan_solve(term_fn: Callable, solver: dfx.AbstractSolver, y0, args, num_steps: int, times=None):
    """y(1) of dy/dt = term_fn(t, y, args) from y(0) = y0 in `num_steps` equal steps of `solver`; with
    `times` (num_steps + 1 increasing times, as diffrax's `StepTo` takes them), y(times[-1]) stepping from
    each time to the next."""
    terms = dfx.ODETerm(term_fn)
    if times is None:
        times = jnp.arange(num_steps + 1, dtype=jnp.result_type(float)) / num_steps
        times = times.at[-1].set(1.0)
    # as diffeqsolve does: the state takes the promotion of y0's and the time's dtypes (a bfloat16 y0
    # is solved in float32), so the scan's carry keeps one dtype through every step
    y0 = jax.tree.map(lambda y: jnp.asarray(y, jnp.result_type(y, times.dtype)), y0)
    state0 = solver.init(terms, times[0], times[1], y0, args)

    @jax.checkpoint
    def step(carry, t):
        y, state = carry
        y1, _, _, state, _ = solver.step(terms, t[0], t[1], y, args, state, made_jump=False)
        return (y1, state), None

    (y1, _), _ = jax.lax.scan(step, (y0, state0), jnp.stack([times[:-1], times[1:]], axis=1))
    return y1
