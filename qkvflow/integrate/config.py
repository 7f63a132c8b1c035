"""How the depth ODE is integrated: solver, step control and gradient method."""

from dataclasses import dataclass
from typing import Optional

from qkvflow.errors import check as _check

from .solvers import ADAPTIVE_BY_DEFAULT, EMBEDDED_ERROR, SOLVERS

ADJOINTS = ("recursive_checkpoint", "direct", "backsolve")
WEIGHT_CACHES = ("precompute", "on_the_fly")
LOOPS = ("diffrax", "scan")


@dataclass(frozen=True)
class OdeConfig:
    """How `integrate` solves dx/dt = F(W(t), x) over t in [0, 1]: which diffrax solver, fixed or
    adaptive steps, which adjoint differentiates the solve, and how W(t) reaches the field.

    The paper's DiffEqFormer uses Euler with N equal steps (N = the baseline's layer count). Every
    value is checked when the config is made; a bad one raises a one-line `UserError` naming the key.
    """

    num_steps: int = 12
    """N: fixed step size dt = 1/N (the paper matches N to the baseline's layer count); for an
    adaptive solver, the size of the first step tried."""
    solver: str = "euler"
    """One of euler (the paper's), heun, midpoint, ralston, rk4, tsit5, dopri5."""
    adaptive: Optional[bool] = None
    """Adaptive step-size control (a PID controller on rtol/atol). None: on for tsit5/dopri5 only."""
    rtol: float = 1e-3
    atol: float = 1e-4
    max_steps: int = 256
    """Bound on the steps an adaptive solve may take (diffrax's `max_steps`)."""
    adjoint: str = "recursive_checkpoint"
    """Gradient method: recursive_checkpoint (online checkpointing, Stumm & Walther 2010), direct,
    or backsolve (continuous adjoint, Chen et al. 2018)."""
    checkpoints: Optional[int] = None
    """States kept by recursive_checkpoint for the backward pass. None: every step of a fixed grid
    (each step is recomputed once, like a transformer's per-layer remat; memory grows with N), and
    equinox's default for adaptive solves (about sqrt(2 max_steps), Stumm & Walther 2010). A fixed
    K keeps memory flat in N at the cost of recomputing steps more than once."""
    weight_cache: str = "precompute"
    """Fixed grids only. precompute: generate W(t) for every evaluation time in one batched
    hypernetwork call before the solve (fast, holds all weights); on_the_fly: generate inside each
    vector-field evaluation (memory flat in N)."""
    loop: str = "diffrax"
    """Fixed grids only. diffrax: `diffeqsolve`; scan: a `lax.scan` over diffrax's solver step with
    per-step remat (`qkvflow.integrate.scan`), the same steps and times without diffrax's loop. The scan
    keeps every step's state (recursive_checkpoint with `checkpoints` null or N) and returns x(1) only."""

    def __post_init__(self):
        _check(self.num_steps >= 1, "ode.num_steps", self.num_steps, "an integer >= 1")
        _check(self.solver in SOLVERS, "ode.solver", self.solver, f"one of {sorted(SOLVERS)}")
        if self.adaptive:
            _check(
                self.solver in EMBEDDED_ERROR,
                "ode.adaptive",
                self.adaptive,
                f"false for solver {self.solver!r}; adaptive control needs one of {sorted(EMBEDDED_ERROR)}",
            )
        _check(self.rtol > 0, "ode.rtol", self.rtol, "a positive float")
        _check(self.atol > 0, "ode.atol", self.atol, "a positive float")
        _check(self.max_steps >= 1, "ode.max_steps", self.max_steps, "an integer >= 1")
        _check(self.adjoint in ADJOINTS, "ode.adjoint", self.adjoint, f"one of {list(ADJOINTS)}")
        if self.checkpoints is not None:
            _check(self.checkpoints >= 1, "ode.checkpoints", self.checkpoints, "null or an integer >= 1")
        _check(
            self.weight_cache in WEIGHT_CACHES, "ode.weight_cache", self.weight_cache, f"one of {list(WEIGHT_CACHES)}"
        )
        _check(self.loop in LOOPS, "ode.loop", self.loop, f"one of {list(LOOPS)}")
        if self.loop == "scan":
            _check(
                not self.is_adaptive,
                "ode.loop",
                self.loop,
                f"'diffrax' for the adaptive solver {self.solver!r} (a scan needs a fixed grid)",
            )
            _check(
                self.adjoint == "recursive_checkpoint" and self.checkpoints in (None, self.num_steps),
                "ode.loop",
                self.loop,
                "'diffrax' unless ode.adjoint is recursive_checkpoint with ode.checkpoints null or ode.num_steps "
                f"(the scan stores every step; got adjoint={self.adjoint!r}, checkpoints={self.checkpoints})",
            )

    @property
    def is_adaptive(self) -> bool:
        """Whether steps are chosen by the PID controller (`adaptive`, or by default for tsit5/dopri5)."""
        return self.solver in ADAPTIVE_BY_DEFAULT if self.adaptive is None else self.adaptive
