"""Seed statistics for `qkvflow bench compare`: mean, spread and a 95% interval of a difference.

For one model, the n seeds' losses x_1..x_n give the mean and the sample standard deviation
(`ddof = 1`). Against the baseline, runs with the same seed share the initialisation key and the
data order, so the comparison is *paired*: with d_i = x_i - y_i over the seeds both have,

    mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n)

is the 95% Student-t interval of the expected difference (Student 1908; any statistics text, e.g.
Wasserman, *All of Statistics*, Sec. 10.7). A negative difference means a lower loss than the
baseline. It assumes the per-seed differences are roughly normal; with n = 3 seeds the t quantile is
4.30, so only large effects are resolved, and the verdict says so instead of ranking by means.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from scipy.stats import t as student_t


@dataclass(frozen=True)
class Summary:
    """Mean and sample standard deviation (None below two values) of n numbers."""

    n: int
    mean: float
    std: Optional[float]


def summarise(values: Sequence[float]) -> Summary:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("summarise: no values")
    n, mean = len(values), math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return Summary(n, mean, std)


@dataclass(frozen=True)
class Difference:
    """The paired difference model - baseline over `seeds`, with its two-sided interval."""

    seeds: tuple
    mean: float
    low: Optional[float]
    high: Optional[float]
    level: float = 0.95

    @property
    def verdict(self) -> str:
        """'lower' / 'higher' when the interval excludes 0, 'no clear difference' when it holds 0,
        'one seed: no interval' when it cannot be computed."""
        if self.low is None:
            return "one seed: no interval"
        if self.high < 0:
            return "lower"
        if self.low > 0:
            return "higher"
        return "no clear difference"


def paired_difference(model: dict, baseline: dict, level: float = 0.95) -> Difference:
    """`model` and `baseline` map seed -> loss; the interval uses the seeds both have."""
    seeds = tuple(sorted(set(model) & set(baseline)))
    if not seeds:
        raise ValueError("paired_difference: the model and the baseline share no seed")
    d = summarise([model[s] - baseline[s] for s in seeds])
    if d.std is None:
        return Difference(seeds, d.mean, None, None, level)
    half = student_t.ppf(0.5 + level / 2, d.n - 1) * d.std / math.sqrt(d.n)
    return Difference(seeds, d.mean, d.mean - half, d.mean + half, level)
