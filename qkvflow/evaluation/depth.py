"""Depth at inference: the same DiffEqFormer evaluated at several solver grids and tolerances.

A DiffEqFormer's weights W(t) are defined for every t in [0, 1], so the solver that integrates
dx/dt = F(W(t), x) is chosen at inference: a fixed grid of N steps (any N, any explicit Runge-Kutta
method), or an adaptive solver with tolerances. Each choice is a `model.ode` (qkvflow.integrate.OdeConfig)
swapped into the model's static config; the parameters are untouched.

Vector-field evaluations (the model's effective depth) per forward pass: for a fixed grid,
`qkvflow.integrate.solvers.evaluations(solver, N)` (N x stages, one fewer per step after the first
for first-same-as-last methods), the count `OdeStats.nfe` reports; for an adaptive solve the number of
steps depends on the input, so it is measured: `OdeStats.nfe` of `model.flow` on every evaluated batch
(diffrax's `stats["num_steps"]`, rejected steps included, turned into evaluations by the same
function), averaged over batches. An adaptive controller picks one step size for a whole batch, so
this count depends on the eval batch size too. `per_sequence_evaluations` solves every sequence
alone instead (`hax.vmap` of the forward solve over the batch axis: diffrax then keeps a step size
and a step count per sequence) and gives their distribution (`distribution`): the depth each input
needs by itself, independent of the batch it came in.

Adaptive rows use rtol = tolerance and atol = tolerance x (model.ode.atol / model.ode.rtol) (1/10 with
the defaults), and the config's `max_steps`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from qkvflow.errors import UserError
from qkvflow.evaluation.grids import parse_list, parse_steps  # noqa: F401  (the grammar, light for the CLI)
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import build_solver
from qkvflow.integrate.solvers import EMBEDDED_ERROR, SOLVERS, evaluations


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One way to integrate the model: `ode` and how to label it."""

    ode: OdeConfig
    tolerance: Optional[float] = None

    @property
    def adaptive(self) -> bool:
        return self.ode.is_adaptive

    @property
    def label(self) -> str:
        return f"tol={self.tolerance:g}" if self.adaptive else f"N={self.ode.num_steps}"


def grid_points(
    base: OdeConfig,
    steps: Sequence[int] = (),
    solvers: Sequence[str] = (),
    tolerances: Sequence[float] = (),
    adaptive_solver: str = "tsit5",
) -> list[GridPoint]:
    """The grid: every solver in `solvers` (default: the config's) at each of `steps` fixed steps (default:
    the config's N), then `adaptive_solver` at each tolerance. No arguments: the config's own solve."""
    for n in steps:
        if isinstance(n, bool) or n < 1:
            raise UserError(f"--steps {n} is invalid: expected integers >= 1 (fixed solver steps N)")
    for tol in tolerances:
        if not (tol > 0 and math.isfinite(tol)):
            raise UserError(f"--tolerances {tol} is invalid: expected positive numbers (rtol of an adaptive solve)")
    for s in solvers:
        if s not in SOLVERS:
            raise UserError(f"--solver {s} is invalid: expected one of {', '.join(SOLVERS)}")
    if tolerances and adaptive_solver not in EMBEDDED_ERROR:
        raise UserError(
            f"--adaptive_solver {adaptive_solver} is invalid: adaptive steps need an error estimate, one of "
            f"{', '.join(sorted(EMBEDDED_ERROR))}"
        )
    if not (steps or solvers or tolerances):
        return [GridPoint(base, base.rtol if base.is_adaptive else None)]
    points = []
    if steps or solvers:
        for solver in solvers or [base.solver]:
            for n in steps or [base.num_steps]:
                points.append(GridPoint(dataclasses.replace(base, solver=solver, num_steps=n, adaptive=False)))
    ratio = base.atol / base.rtol
    for tol in tolerances:
        ode = dataclasses.replace(base, solver=adaptive_solver, adaptive=True, rtol=tol, atol=tol * ratio)
        points.append(GridPoint(ode, tol))
    return points


def same_solve(a: OdeConfig, b: OdeConfig) -> bool:
    """Whether `a` and `b` integrate alike: solver, fixed N or adaptive tolerances (not the gradient settings)."""
    if (a.solver, a.is_adaptive) != (b.solver, b.is_adaptive):
        return False
    return (
        (a.rtol, a.atol, a.max_steps, a.num_steps) == (b.rtol, b.atol, b.max_steps, b.num_steps)
        if a.is_adaptive
        else a.num_steps == b.num_steps
    )


def with_ode(model, ode: OdeConfig):
    """`model` integrated with `ode` instead of its config's (same parameters). Evaluation reads the
    output at t = 1 alone, so a model trained with `exits: aligned` (`qkvflow.models.related.ode_exits`) is
    evaluated as one without, and the depth-dial recipes (`qkvflow.models.depth_dial`), which change
    training steps only, are dropped: any grid applies, adaptive ones included."""
    changes = {"ode": ode}
    if getattr(model.config, "exits", "none") != "none":
        changes["exits"] = "none"
    dial = getattr(model.config, "dial", None)
    if dial is not None and dial.active:
        changes["dial"] = type(dial)()
    return dataclasses.replace(model, _config=dataclasses.replace(model.config, **changes))


def fixed_evaluations(ode: OdeConfig) -> int:
    return int(evaluations(build_solver(ode), ode.num_steps))


def measured_evaluations(model, evaluator, mp) -> tuple[float, int, int]:
    """(mean, min, max) over the evaluator's batches of the vector-field evaluations of one forward
    solve (`OdeStats.nfe` from `model.flow`)."""
    import haliax as hax
    from levanter.utils.tree_utils import inference_mode

    @hax.named_jit(axis_resources=evaluator.axis_mapping)
    def nfe(model, batch):
        model = mp.cast_to_compute(inference_mode(model, True))
        return model.flow(batch.tokens, batch.attn_mask)[2].nfe

    counts = [int(nfe(model, batch)) for batch, _tags in evaluator.loader]
    return float(np.mean(counts)), min(counts), max(counts)


def per_sequence_evaluations(model, evaluator, mp) -> np.ndarray:
    """Vector-field evaluations of the forward solve of every evaluated sequence solved alone (a
    vmap over the batch axis); sequences with no loss weight (a loader's padding) are left out."""
    import haliax as hax
    from levanter.utils.tree_utils import inference_mode

    @hax.named_jit(axis_resources=evaluator.axis_mapping)
    def nfe(model, batch):
        model = mp.cast_to_compute(inference_mode(model, True))
        (Batch,) = [a for a in batch.tokens.axes if a.name != model.Pos.name]
        counts = hax.vmap(lambda tokens, mask: model.flow(tokens, mask)[2].nfe, Batch)(batch.tokens, batch.attn_mask)
        return counts, hax.sum(batch.loss_weight, model.Pos.name).array > 0

    out = []
    for batch, _tags in evaluator.loader:
        counts, real = nfe(model, batch)
        out.append(np.asarray(counts)[np.asarray(real)])
    return np.concatenate(out)


QUANTILES = (0.1, 0.5, 0.9)


def distribution(counts) -> dict:
    """mean, min, the QUANTILES (numpy's linear interpolation, keys q10 q50 q90) and max of `counts`."""
    counts = np.asarray(counts, dtype=np.float64)
    out = {"sequences": int(counts.size), "mean": float(counts.mean()), "min": int(counts.min())}
    out |= {f"q{round(q * 100)}": float(np.quantile(counts, q)) for q in QUANTILES}
    return out | {"max": int(counts.max())}


def per_sequence_table(rows: list[dict]) -> str:
    """Markdown: the per-sequence distribution of the adaptive rows that have one."""
    lines = [
        "| solver | tolerance | sequences | mean | min | q10 | q50 | q90 | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r.get("nfe_per_sequence")
        if d:
            cells = [r["solver"], r["grid"], d["sequences"], f"{d['mean']:.1f}", d["min"]]
            cells += [f"{d[k]:g}" for k in ("q10", "q50", "q90")] + [d["max"]]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


COLUMNS = ("solver", "steps or tolerance", "vector-field evaluations", "loss", "perplexity", "bpb")


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        grid = r["grid"] + (" (trained)" if r.get("trained") else "") + (" (auto)" if r.get("auto") else "")
        nfe = r["nfe"]
        if nfe is None:
            nfe_text = "-"
        elif r.get("nfe_min") is not None and r["nfe_min"] != r["nfe_max"]:
            nfe_text = f"{nfe:.1f} ({r['nfe_min']}-{r['nfe_max']})"
        else:
            nfe_text = f"{nfe:g}"
        cells = [r["solver"], grid, nfe_text, f"{r['loss']:.4f}", f"{r['perplexity']:.2f}", f"{r['bpb']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str = "") -> str:
    """Perplexity against vector-field evaluations (log x): one line per solver and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["nfe"] is not None:
            groups.setdefault(r["solver"] + (" (adaptive)" if r["tolerance"] is not None else ""), []).append(r)
    for name, group in groups.items():
        group = sorted(group, key=lambda r: r["nfe"])
        ax.plot([r["nfe"] for r in group], [r["perplexity"] for r in group], "o-", label=name, markersize=4)
        for r in group:
            ax.annotate(r["grid"], (r["nfe"], r["perplexity"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    trained = [r for r in rows if r.get("trained")]
    if trained:
        ax.plot(
            [r["nfe"] for r in trained], [r["perplexity"] for r in trained], "k*", markersize=10, label="trained grid"
        )
    ax.set_xscale("log")
    ax.set_xlabel("vector-field evaluations per forward pass")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
