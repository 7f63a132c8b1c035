"""Depth-adaptive exits in continuous depth: the Depth-Adaptive Transformer (Elbayad et al., ICLR 2020)
carried to the DiffEqFormer's depth time t.

On a fixed grid of N steps (t_k = k / N) every grid time is an exit, read through the model's own final
norm and (tied or separate) unembedding U:

    logits_k = norm(x(t_k)) @ U,        k = 1..N          (logits_N: the model's usual output)

**Aligned training** (`exits: aligned`) minimises the uniform mean of the exits' next-token losses,

    L = 1/N sum_k CE(logits_k),

with x(t_k) saved by diffrax's `SaveAt(ts=...)` from the one solve (`exit_states`, `aligned_loss`).

**Halting** (evaluation): token i halts at the first grid time t_k, k < N, at which its exit is confident,
max_v softmax(logits_k)_iv > tau, and its state is frozen from there on: with h_i = 1 once halted,

    dx_i/dt = (1 - h_i(t_k)) F_i(W(t), x(t))     on [t_k, t_{k+1}],

integrated segment by segment with diffrax, h updated between segments (`halting_flow`). The attention of
every token still reads all tokens' current states, a halted token's frozen one included, so under
teacher forcing this is the discrete `where(exited, x, block(x))` of the paper. A token's logits are its
exit's: norm(x_i(t_exit)) @ U, the readout of its frozen final state.

Accounting per token: NFE = field evaluations while not halted (stages per step x steps before halting);
exit time = t_k at halting (1 if never); threshold tests = grid times t_1..t_{N-1} at which it was tested,
each costing one extra readout, 2 V d FLOPs.
"""

from typing import NamedTuple

import diffrax as dfx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.loss import maybe_fused_next_token_loss

from qkvflow.errors import UserError
from qkvflow.integrate.solve import build_solver
from qkvflow.integrate.solvers import evaluations
from qkvflow.integrate.weight_source import WeightSource


def exit_times(ode) -> np.ndarray:
    """t_k = k / N for k = 1..N (float32), the grid times at which the exits read the state."""
    n = ode.num_steps
    return np.array([k / n for k in range(1, n + 1)], dtype=np.float32)


def check_fixed_grid(config) -> None:
    """Exits need a fixed grid: one line naming the key otherwise."""
    if config.ode.is_adaptive:
        raise UserError(
            f"ode.solver={config.ode.solver!r} is adaptive: exits and halting need a fixed grid of "
            "ode.num_steps steps (a fixed-step solver, or ode.adaptive: false)"
        )


def readout(model, x: NamedArray) -> NamedArray:
    """Exit logits norm(x) @ U (any leading axes)."""
    return hax.dot(model.final_norm(x), model.get_lm_head(), axis=model.Embed)


def exit_states(model, input_ids: NamedArray, attn_mask=None, *, pos_ids=None):
    """(x(t_1..t_N) on an `exit` axis, kinetic energy at t = 1 or None, solver stats) of one solve."""
    check_fixed_grid(model.config)
    return model.flow(input_ids, attn_mask, pos_ids=pos_ids, ts=jnp.asarray(exit_times(model.config.ode)))


def aligned_loss(model, tokens: NamedArray, attn_mask, loss_weight, *, z_loss_weight: float = 0.0, block_size=None):
    """(1/N sum_k CE(logits_k), [CE(logits_k) for k = 1..N], energy, stats): each CE is Levanter's fused
    next-token loss, exactly the t = 1 loss of the plain model applied to x(t_k) (at vocabulary block
    `block_size`, by default the model's `cross_entropy_block_size`)."""
    xs, energy, stats = exit_states(model, tokens, attn_mask)
    per_exit = []
    for k in range(xs.resolve_axis("exit").size):
        per_exit.append(
            maybe_fused_next_token_loss(
                model.Pos,
                model.Embed,
                model.Vocab,
                model.final_norm(xs["exit", k]),
                model.get_lm_head(),
                tokens,
                loss_weight=loss_weight,
                logsumexp_weight=z_loss_weight,
                dtype=jnp.float32,
                block_size=model.config.cross_entropy_block_size if block_size is None else block_size,
            )
        )
    loss = sum(per_exit) / len(per_exit)
    return loss, per_exit, energy, stats


class Halting(NamedTuple):
    """What `halting_flow` returns; per-token arrays have the input's axes."""

    logits: NamedArray
    """Each token's logits at its exit (the readout of its final, possibly frozen, state)."""
    state: NamedArray
    """Final states, before the norm."""
    exit_step: NamedArray
    """k of the exit time t_k = k / N at which the token halted (N: never halted)."""
    nfe: NamedArray
    """Field evaluations the token received while not halted."""
    tests: NamedArray
    """Threshold tests (extra readouts) the token took: grid times t_1..t_{N-1} reached unhalted."""


def halting_flow(model, input_ids: NamedArray, tau, attn_mask=None, *, pos_ids=None, halt_at=None) -> Halting:
    """Solve with tokens frozen once their exit's confidence exceeds `tau` (the module docstring).

    `halt_at` (optional, int per token, axes of `input_ids`) replaces the confidence rule with a given
    pattern: the token halts at grid time t_{halt_at} (values >= N: never), for tests and analyses.
    """
    config = model.config
    check_fixed_grid(config)
    ode, n = config.ode, config.ode.num_steps
    if attn_mask is None:
        attn_mask = AttentionMask.causal()
    if pos_ids is None:
        pos_ids = hax.arange(input_ids.resolve_axis(model.Pos.name), dtype=jnp.int32)
    x0 = model.embed(input_ids, pos_ids)
    axes = x0.axes
    field = model.raw_field(axes, x0.dtype)
    source = WeightSource.build(model.generator, ode)
    solver = build_solver(ode)
    per_step = int(evaluations(solver, 1))
    token_axes = input_ids.axes

    def frozen_field(t, y, args):
        inner, live = args
        return field(t, y, inner) * live

    def segment(carry, k):
        y, halted, exit_step, nfe, tests = carry
        live = hax.broadcast_to(1.0 - halted.astype(y.dtype), axes).rearrange(axes).array
        t0 = k.astype(jnp.float32) / n
        t1 = (k + 1).astype(jnp.float32) / n
        solution = dfx.diffeqsolve(
            dfx.ODETerm(frozen_field),
            solver,
            t0=t0,
            t1=t1,
            dt0=t1 - t0,
            y0=y,
            args=((source, attn_mask, pos_ids), live),
            saveat=dfx.SaveAt(t1=True),
            stepsize_controller=dfx.ConstantStepSize(),
            max_steps=1,
            throw=False,
        )
        y = solution.ys[-1]
        nfe = nfe + per_step * (1 - halted.astype(jnp.int32))
        tested = hax.logical_and(hax.logical_not(halted), k + 1 < n)
        if halt_at is None:
            logits = readout(model, hax.named(y, axes)).astype(jnp.float32)
            confidence = hax.exp(hax.max(logits, model.Vocab) - hax.nn.logsumexp(logits, model.Vocab))
            confident = confidence > tau
        else:
            confident = halt_at == k + 1
        newly = hax.logical_and(tested, confident)
        exit_step = hax.where(newly, k + 1, exit_step)
        return (y, hax.logical_or(halted, newly), exit_step, nfe, tests + tested.astype(jnp.int32)), None

    zeros = hax.zeros(token_axes, dtype=jnp.int32)
    carry = (x0.array, hax.zeros(token_axes, dtype=bool), zeros + n, zeros, zeros)
    (y, _, exit_step, nfe, tests), _ = jax.lax.scan(segment, carry, jnp.arange(n))
    state = hax.named(y, axes)
    return Halting(readout(model, state), state, exit_step, nfe, tests)
