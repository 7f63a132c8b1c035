"""The named shape of one layer weight that a generator makes, and a generated matrix's initial std."""

import math
from dataclasses import dataclass
from typing import Literal

from haliax import Axis


@dataclass(frozen=True)
class WeightSpec:
    """Named shape of one layer weight. A matrix maps `in_axes` to `out_axes`."""

    out_axes: tuple[Axis, ...]
    kind: Literal["matrix", "bias", "norm"]
    in_axes: tuple[Axis, ...] = ()

    @property
    def axes(self) -> tuple[Axis, ...]:
        return (*self.in_axes, *self.out_axes)


def matrix_std(spec: WeightSpec, config) -> float:
    """Initial std of a generated matrix: initializer_range ("normal", HF GPT-2's 0.02), or
    1/sqrt(fan_in) ("fan_in", haliax's Linear default, which Levanter's GPT-2 and Llama use)."""
    if config.matrix_init == "fan_in":
        return math.prod(a.size for a in spec.in_axes) ** -0.5
    return config.initializer_range
