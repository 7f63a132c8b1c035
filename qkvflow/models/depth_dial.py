"""Training recipes that ask a DiffEqFormer's ODE to be resolved, so its depth can be chosen when it runs.

A DiffEqFormer trained on one fixed grid of N Euler steps is a N-step network: nothing asks the field to
be smooth between the times it sees (issue 33). Each recipe below is off by default; `DepthDialConfig`
(the model config's `dial:` section) turns them on, and they act in training only (the loss is given
Levanter's per-step key; evaluation, which passes none, solves on the config's own grid):

- `train_steps`: per batch, a step count n drawn uniformly from this set (e.g. N/2, N, 2N); the solve
  for each n is traced once and `jax.lax.switch` picks one, so the program holds one solve per n.
- `jitter`: the inner grid times t_k = (k + jitter (u_k - 1/2)) / n, u_k ~ U(0, 1), k = 1..n-1, with
  t_0 = 0 and t_n = 1: each time stays within half a step of k/n and the grid still spans [0, 1]
  (diffrax's `StepTo` solves on it).
- `random_time` (Euler only): step k takes W at t_k + v_k (t_{k+1} - t_k), v_k ~ U(0, 1), instead of at
  t_k: the random Euler scheme of Jentzen & Neuenkirch (2009, "A random Euler scheme for Caratheodory
  differential equations"), first order like Euler. No time is then evaluated by every grid, t = 0
  included, so the field cannot learn an impulse at one (docs/results.md, "Depth as a dial").
- `steer`: STEER (Ghosh et al., 2020): the end time T ~ U(1 - steer, 1 + steer), the grid scaled to [0, T].
- `consistency_weight`: + w * KL(p_fine || p_coarse), the mean over weighted positions of the KL between
  the next-token distributions of the drawn solve and of one on the same grid with each step cut into
  `consistency_factor` equal steps (gradients through both).
- `jacobian_weight`: + w * int_0^T ||d F / d x||_F^2 dt / tokens, the Jacobian Frobenius regulariser of
  Finlay et al. (2020, "How to train your neural ODE"), with Hutchinson's estimator
  ||J||_F^2 = E ||J e||^2, one Gaussian probe e per batch, J e by forward-mode (`jax.jvp`), integrated
  alongside the state.

The key is Levanter's training key of the step (checkpointed with the trainer state), so a run draws the
same grids when repeated or resumed.
"""

from dataclasses import dataclass, replace
from typing import Optional

import jax
import jax.numpy as jnp
import jax.random as jrandom

from qkvflow.errors import check as _check
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import OdeStats, integrate
from qkvflow.integrate.weight_source import WeightSource


@dataclass(frozen=True)
class DepthDialConfig:
    """The depth-dial training recipes (module docstring); every default leaves training as it was."""

    train_steps: tuple[int, ...] = ()
    """Step counts to draw one of per batch; () trains at ode.num_steps only."""
    jitter: float = 0.0
    """In [0, 1): inner grid times move by up to jitter/2 of a step; 0: the uniform grid."""
    random_time: bool = False
    """Euler only: each step generates W at a uniformly drawn time within it, not at its start."""
    steer: float = 0.0
    """In [0, 1): STEER's end time T ~ U(1 - steer, 1 + steer); 0: T = 1."""
    consistency_weight: float = 0.0
    """Weight of KL(fine || coarse) between the drawn solve and a `consistency_factor` times finer one."""
    consistency_factor: int = 2
    jacobian_weight: float = 0.0
    """Weight of the Hutchinson estimate of int ||dF/dx||_F^2 dt per token (Finlay et al. 2020)."""

    def __post_init__(self):
        for n in self.train_steps:
            _check(isinstance(n, int) and n >= 1, "dial.train_steps", list(self.train_steps), "integers >= 1")
        _check(0 <= self.jitter < 1, "dial.jitter", self.jitter, "a float in [0, 1)")
        _check(isinstance(self.random_time, bool), "dial.random_time", self.random_time, "true or false")
        _check(0 <= self.steer < 1, "dial.steer", self.steer, "a float in [0, 1)")
        _check(self.consistency_weight >= 0, "dial.consistency_weight", self.consistency_weight, "a float >= 0")
        _check(self.consistency_factor >= 2, "dial.consistency_factor", self.consistency_factor, "an integer >= 2")
        _check(self.jacobian_weight >= 0, "dial.jacobian_weight", self.jacobian_weight, "a float >= 0")

    @property
    def active(self) -> bool:
        """Whether any recipe is on (training then goes through `drawn_solves`)."""
        recipes = (self.jitter, self.steer, self.consistency_weight, self.jacobian_weight)
        return bool(self.train_steps) or self.random_time or any(w > 0 for w in recipes)


def training_solves(config) -> list[tuple[int, float]]:
    """The solves one training batch of the DiffEqFormer `config` runs on average, as (step count, expected
    number per batch): each drawn count with probability 1/len(train_steps) (else ode.num_steps), and with
    the consistency term the same again at `consistency_factor` times the count. For FLOP accounting
    (`qkvflow bench compare`); the Jacobian term's forward-mode tangents are not solves and not counted."""
    dial: DepthDialConfig = config.dial
    counts = dial.train_steps or (config.ode.num_steps,)
    solves = [(n, 1.0 / len(counts)) for n in counts]
    if dial.consistency_weight > 0:
        solves += [(dial.consistency_factor * n, 1.0 / len(counts)) for n in counts]
    return solves


def sample_grid(n: int, dial: DepthDialConfig, key) -> Optional[jax.Array]:
    """The n + 1 times of one training solve (module docstring); None for the uniform grid on [0, 1]."""
    if not (dial.jitter or dial.steer or dial.random_time):
        return None
    k_jitter, k_end = jrandom.split(key)
    k = jnp.arange(1, n, dtype=jnp.float32)
    u = jrandom.uniform(k_jitter, (n - 1,), jnp.float32)
    inner = (k + dial.jitter * (u - 0.5)) / n
    grid = jnp.concatenate([jnp.zeros(1, jnp.float32), inner, jnp.ones(1, jnp.float32)])
    end = 1.0 + dial.steer * (2.0 * jrandom.uniform(k_end, (), jnp.float32) - 1.0)
    return grid * end


def stage_shift(grid: Optional[jax.Array], dial: DepthDialConfig, key) -> Optional[jax.Array]:
    """`random_time`'s shifts v_k (t_{k+1} - t_k), v_k ~ U(0, 1), one per Euler step of `grid` (None when
    off), for `WeightSource.build(shift=)`. `key` is the one `sample_grid` got: a fold of it is used, so
    turning this on leaves the other recipes' draws as they were."""
    if not dial.random_time:
        return None
    steps = jnp.diff(grid)
    return jrandom.uniform(jrandom.fold_in(key, 1), steps.shape, jnp.float32) * steps


def refine(grid: Optional[jax.Array], factor: int) -> Optional[jax.Array]:
    """`grid` with each interval cut into `factor` equal ones (None stays None: the uniform grid)."""
    if grid is None:
        return None
    s = jnp.arange(factor, dtype=grid.dtype) / factor
    inner = (grid[:-1, None] + s[None, :] * jnp.diff(grid)[:, None]).reshape(-1)
    return jnp.concatenate([inner, grid[-1:]])


def solve(model, input_ids, mask, ode: OdeConfig, grid=None, probe=None, kinetic: bool = False, shift=None):
    """x(T) (raw array, in the embedding's dtype as `DiffEqFormer.flow` returns it), kinetic energy or None,
    Jacobian estimate or None, and `OdeStats` of one solve of `model` (a DiffEqFormer) on `grid` (None:
    ode's uniform grid); `probe` (shaped like the state) adds the Hutchinson Frobenius term; `shift` moves
    where W is generated (`stage_shift`)."""
    import haliax as hax
    from levanter.layers.attention import AttentionMask

    mask = AttentionMask.causal() if mask is None else mask
    pos_ids = hax.arange(input_ids.resolve_axis(model.Pos.name), dtype=jnp.int32)
    x0 = model.embed(input_ids, pos_ids)
    tokens = x0.size // model.config.hidden_dim
    field = model.raw_field(x0.axes, x0.dtype)
    args = (WeightSource.build(model.generator, ode, grid=grid, shift=shift), mask, pos_ids)
    if probe is None:
        y, energy, stats = integrate(field, x0.array, args, ode, tokens=tokens if kinetic else None, grid=grid)
        return y.astype(x0.dtype), energy, None, stats

    def augmented(t, state, args):
        *field_args, e = args
        dy, jv = jax.jvp(lambda y: field(t, y, tuple(field_args)), (state[0],), (e,))
        square = lambda a: jnp.sum(jnp.square(a.astype(jnp.float32))) / tokens  # noqa: E731
        return dy, square(dy), square(jv)

    zero = jnp.zeros((), jnp.float32)
    (y, energy, frobenius), _, stats = integrate(augmented, (x0.array, zero, zero), (*args, probe), ode, grid=grid)
    # the evaluations of the jvp's tangent are not counted: stats.nfe is the primal solve's
    return y.astype(x0.dtype), (energy if kinetic else None), frobenius, stats


def drawn_solves(model, input_ids, mask, key):
    """The training solves for one batch: (x coarse, x fine or None, energy, Frobenius or None, OdeStats,
    the drawn step count), every array raw. With several `train_steps` the solve for each count is
    traced once and `jax.lax.switch` runs the drawn one."""
    config = model.config
    dial: DepthDialConfig = config.dial
    counts = dial.train_steps or (config.ode.num_steps,)
    k_steps, k_grid, k_probe = jrandom.split(key, 3)
    kinetic = config.kinetic_weight > 0

    def branch(n):
        def run(_):
            ode = replace(config.ode, num_steps=n)
            grid = sample_grid(n, dial, k_grid)
            shift = stage_shift(grid, dial, k_grid)
            probe = None
            if dial.jacobian_weight > 0:
                shape = (*(a.size for a in input_ids.axes), config.hidden_dim)
                probe = jrandom.normal(k_probe, shape, jnp.float32)
            x, energy, frobenius, stats = solve(model, input_ids, mask, ode, grid, probe, kinetic, shift)
            fine = None
            if dial.consistency_weight > 0:
                f = dial.consistency_factor
                fine_ode = replace(ode, num_steps=f * n)
                fine, _, _, fine_stats = solve(model, input_ids, mask, fine_ode, refine(grid, f))
                stats = OdeStats(stats.num_steps + fine_stats.num_steps, stats.nfe + fine_stats.nfe)
            stats = OdeStats(jnp.asarray(stats.num_steps, jnp.int32), jnp.asarray(stats.nfe, jnp.int32))
            return x, fine, energy, frobenius, stats, jnp.asarray(n, jnp.int32)

        return run

    if len(counts) == 1:
        return branch(counts[0])(None)
    index = jrandom.randint(k_steps, (), 0, len(counts))
    return jax.lax.switch(index, [branch(n) for n in counts], None)
