"""Runge-Kutta blocks: each layer is one explicit Runge-Kutta step of size h = 1 whose stages all use
that layer's parameters (the ODE Transformer, Li et al., 2022, "ODE Transformer: An Ordinary
Differential Equation-Inspired Model for Sequence Generation", ACL, Section 3).

With F(y) the layer's whole pre-norm increment (here the parallel block's attention plus
feed-forward, `ParallelBlock.increment`):

    euler       y + F1                                    F1 = F(y)
    rk2         y + (F1 + F2) / 2                         F2 = F(y + F1)
    rk2_unit    y + F1 + F2                               (RK2 with gamma = 1)
    rk2_scalar  y + g1 F1 + g2 F2                         g1, g2 learned scalars, initialised at 1
    rk2_gated   y + g F1 + (1 - g) F2                     g = sigmoid([F1, F2] W + b), one gate per token
    rk4         y + (F1 + 2 F2 + 2 F3 + F4) / 6           F2 = F(y + F1/2), F3 = F(y + F2/2), F4 = F(y + F3)

This is not a solver option of the DiffEqFormer: there every stage reads W(t) at its own time, while
here all stages of a layer share one set of weights.
"""

from typing import Callable, Optional, Sequence

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from qkvflow.nn.random import normal

STAGES = {"euler": 1, "rk2": 2, "rk2_unit": 2, "rk2_scalar": 2, "rk2_gated": 2, "rk4": 4}
BLOCK_SCHEMES = tuple(STAGES)
Branch = Axis("branch", 2)  # [F1, F2] for the gate and the two learned scalars


class RkGate(eqx.Module):
    """g = sigmoid([F1, F2] W + b): a scalar per token from both stages (W over branch x embed)."""

    weight: NamedArray  # (branch, embed)
    bias: NamedArray  # scalar

    @staticmethod
    def init(Embed: Axis, std: float, *, key) -> "RkGate":
        weight = normal(key, (Branch, Embed)) * std
        return RkGate(weight, hax.named(jnp.zeros(()), ()))

    def __call__(self, f1: NamedArray, f2: NamedArray) -> NamedArray:
        both = hax.stack(Branch, [f1, f2])
        return hax.nn.sigmoid(hax.dot(both, self.weight, axis=(Branch, self.weight.axes[1])) + self.bias)


def init_scheme_parameters(scheme: str, Embed: Axis, std: float, *, key):
    """(gamma, gate) of a block: the learned scalars of rk2_scalar (ones), the gate of rk2_gated; None otherwise."""
    gamma = hax.ones(Branch) if scheme == "rk2_scalar" else None
    gate = RkGate.init(Embed, std, key=key) if scheme == "rk2_gated" else None
    return gamma, gate


def rk_step(
    scheme: str,
    increment: Callable[[NamedArray, int], NamedArray],
    y: NamedArray,
    gamma: Optional[NamedArray] = None,
    gate: Optional[RkGate] = None,
) -> NamedArray:
    """One step of `scheme` (see the module docstring); `increment(y, stage)` is F, told which stage
    (0-based) calls it, so that a decoder can give each stage its own key/value cache."""
    f1 = increment(y, 0)
    if scheme == "euler":
        return y + f1
    if scheme == "rk4":
        f2 = increment(y + f1 * 0.5, 1)
        f3 = increment(y + f2 * 0.5, 2)
        f4 = increment(y + f3, 3)
        return y + (f1 + f2 * 2.0 + f3 * 2.0 + f4) / 6.0
    f2 = increment(y + f1, 1)
    if scheme == "rk2":
        return y + (f1 + f2) * 0.5
    if scheme == "rk2_unit":
        return y + f1 + f2
    if scheme == "rk2_scalar":
        return y + gamma[Branch, 0] * f1 + gamma[Branch, 1] * f2
    if scheme == "rk2_gated":
        g = gate(f1, f2)
        return y + g * f1 + (1.0 - g) * f2
    raise ValueError(f"unknown block scheme {scheme!r}")


def stage_list(attend_fn, stages: int) -> Sequence:
    """One attention function per stage: `attend_fn` itself when it is a sequence, else it repeated."""
    if isinstance(attend_fn, (list, tuple)):
        if len(attend_fn) != stages:
            raise ValueError(f"{len(attend_fn)} attention functions for {stages} stages")
        return attend_fn
    return [attend_fn] * stages
