"""`--steps auto`: the cheapest fixed grid whose loss is within a tolerance of the best one's.

A DiffEqFormer can be solved on any grid at inference (`qkvflow.evaluation.depth`). `--steps auto`
scores candidate grids g (by default N/4, N/2, N, 2N and 4N steps of the model's solver, the grids of
the depth-dial study, docs/results.md "Depth as a dial") on validation data and runs at

    g* = argmin  E(g)   over the g with  L(g) <= min_h L(h) + tol,

where L(g) is the mean loss per target token at g, E(g) the vector-field evaluations of one forward
pass, and tol the tolerance in nats (ties: the lower loss, then the earlier candidate). For a model
whose flow is resolved the lowest loss is the finest grid's and g* is the coarsest grid that agrees
with it; for a model bound to the grid it was trained on (today's default) g* is usually that grid.
The reference is the lowest loss rather than the finest grid's, because on a grid-bound model the
finest grid is not its best: "within tol of 4N" would there accept a grid far worse than N.

The choice is made on the data it is scored on. To report losses free of that selection, choose on
one split and report on another: with a `corpus:` section, `qkvflow eval --steps auto --auto_split
selection --corpus.eval_split test` scores the candidates on the selection half of the validation
documents and every row of its table on the test half (`qkvflow.data.corpora.EVAL_SPLITS`).

The rule on a verb's options, shared by `qkvflow eval` and `qkvflow generate`: `check_auto` (the
--auto_* options valid with --steps auto, refused without it), `on_auto_split` (the config whose data
the candidates are scored on) and `mark_auto` (the choice among scored rows, marked in the table).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from qkvflow.data.corpora import EVAL_SPLITS
from qkvflow.errors import UserError
from qkvflow.evaluation.grids import parse_steps

GRIDS = "N/4,N/2,N,2N,4N"
"""The candidates of `--steps auto` (`--auto_grids`), relative to the trained N."""
TOLERANCE = 0.01
"""`--auto_tolerance`: nats per token above the lowest loss (issue 33's bound for 2N and 4N against N)."""
OPTIONS = ("--auto_grids", "--auto_tolerance", "--auto_split")
"""The options of `--steps auto` (eval's and generate's), refused without it (`check_auto`)."""


def candidates(text: str, trained: int) -> list[int]:
    """The grids of `--auto_grids`, parsed as `--steps` (`qkvflow.evaluation.depth.parse_steps`); of the
    default N/4,N/2,N,2N,4N, the fractions that are not whole numbers are left out (N = 2: 1, 2, 4, 8)."""
    if text.strip() == GRIDS:
        return [trained * k // 4 for k in (1, 2, 4, 8, 16) if trained * k % 4 == 0]
    return parse_steps(text, trained, key="auto_grids")


def check_tolerance(tolerance: float) -> None:
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
        raise UserError(f"--auto_tolerance {tolerance!r} is invalid: expected a number of nats >= 0")


def choose(rows: Sequence[dict], tolerance: float) -> tuple[int, int]:
    """(chosen, best): indices into `rows` (dicts with `nfe` and `loss`) of g* and of the lowest loss."""
    check_tolerance(tolerance)
    finite = [i for i, r in enumerate(rows) if math.isfinite(r["loss"])]
    if not finite:
        raise UserError("--steps auto: every candidate grid gave a non-finite loss; pass --steps N explicitly")
    best = min(finite, key=lambda i: (rows[i]["loss"], i))
    within = [i for i in finite if rows[i]["loss"] <= rows[best]["loss"] + tolerance]
    chosen = min(within, key=lambda i: (rows[i]["nfe"], rows[i]["loss"], i))
    return chosen, best


def summary(rows: Sequence[dict], chosen: int, best: int, tolerance: float, split: Optional[str] = None) -> str:
    """One line: what `--steps auto` chose, and against what (the losses of `rows`, scored on `split`)."""
    c, b = rows[chosen], rows[best]
    on = f" on the {split} split" if split else ""
    line = (
        f"steps auto: {c['solver']} N={c['steps']} ({c['nfe']:g} vector-field evaluations, loss {c['loss']:.4f}{on}), "
        f"the fewest evaluations within {tolerance:g} nats of the lowest loss"
    )
    if chosen == best:
        return line + " (its own)"
    return line + f" ({b['solver']} N={b['steps']}: {b['loss']:.4f}, {b['nfe']:g} evaluations)"


def is_auto(config) -> bool:
    return isinstance(config.steps, str) and config.steps.strip() == "auto"


def check_auto(config) -> None:
    """The options of --steps auto (eval's and generate's): valid with it, refused without it."""
    given = [
        key
        for key, value, default in zip(
            OPTIONS,
            (config.auto_grids, config.auto_tolerance, config.auto_split),
            (GRIDS, TOLERANCE, None),
        )
        if value != default
    ]
    if not is_auto(config):
        if given:
            raise UserError(f"{' and '.join(given)}: only with --steps auto (expected --steps auto, or no {given[0]})")
        return
    check_tolerance(config.auto_tolerance)
    if config.auto_split is not None:
        if config.corpus is None:
            raise UserError(
                f"--auto_split {config.auto_split}: needs a corpus: section (its selection and test halves); "
                "with a data: section, choose on one validation set and evaluate --steps K on another"
            )
        if config.auto_split not in EVAL_SPLITS:
            raise UserError(f"--auto_split {config.auto_split!r} is invalid: expected one of {', '.join(EVAL_SPLITS)}")


def on_auto_split(config):
    """`config` (before `with_corpus`) with its corpus evaluated on --auto_split: the data --steps auto scores."""
    if config.auto_split is None:
        return config
    return dataclasses.replace(config, corpus=dataclasses.replace(config.corpus, eval_split=config.auto_split))


def mark_auto(rows: list[dict], tolerance: float, scored: Optional[list[dict]] = None, split=None) -> dict:
    """`--steps auto`: chooses among `scored` (the same grids scored on `split`; default: the fixed-grid
    `rows` themselves), marks the chosen grid's row (`auto`), returns what was chosen and on what."""
    fixed = [r for r in rows if r["tolerance"] is None]
    candidates = fixed if scored is None else scored
    chosen, best = choose(candidates, tolerance)
    grid = lambda r: (r["solver"], r["steps"])  # noqa: E731
    for r in fixed:
        if grid(r) == grid(candidates[chosen]):
            r["auto"] = True
    keep = ("solver", "steps", "nfe", "loss")
    out = {
        "tolerance": tolerance,
        "split": split,
        "chosen": {k: candidates[chosen][k] for k in keep},
        "best": {k: candidates[best][k] for k in keep},
        "summary": summary(candidates, chosen, best, tolerance, split),
    }
    if scored is not None:
        out["scores"] = [{k: r[k] for k in keep} for r in scored]
    return out
