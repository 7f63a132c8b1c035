"""The learning-rate grid of a `qkvflow bench compare` model: the choice, its edge, and extending past it.

Per model, the peak learning rate with the lowest mean selection loss over the seeds is chosen (`choose`;
the first in the grid's order on a tie). A choice at the lowest or highest rate of a grid of two or more
rates is *at the grid's edge* (`edge`): the loss may still fall beyond it, so the comparison is not settled
there, and the report says so. With `--extend_grid K` the harness adds the next rate beyond that edge
(`beyond`: half the lowest rate, or twice the highest; a rate must stay below 1), trains it on every seed
and chooses again, until the choice is interior or K rates have been added to the model's grid. Runs of
the added rates are results like any other: a later invocation reads them back.
"""

import math
from typing import Optional

LIMIT = 3
"""Rates `--extend_grid` adds to one model's grid at most, when given without a number."""


def choose(losses: dict) -> float:
    """The rate of `losses` (rate -> the seeds' selection losses) with the lowest mean; the first on a tie."""
    return min(losses, key=lambda lr: math.fsum(losses[lr]) / len(losses[lr]))


def edge(best: float, grid: list) -> Optional[str]:
    """'lowest' or 'highest' when `best` is that end of `grid` (two or more rates), else None."""
    if len(set(grid)) < 2:
        return None
    if best == min(grid):
        return "lowest"
    if best == max(grid):
        return "highest"
    return None


def beyond(grid: list, side: str) -> Optional[float]:
    """The next rate past the `side` end of `grid`: half its lowest or twice its highest; None at 1 or above."""
    rate = min(grid) / 2 if side == "lowest" else max(grid) * 2
    return rate if rate < 1 else None
