"""Weight generators: t -> the named weights of one transformer layer.

A generator is the only place time enters the model. The vector field (`qkvflow.models.fields`)
reads whatever dict of named arrays a generator returns, so the DiffEqFormer and its baselines
differ only here:

* `HyperGenerator` (DiffEqFormer): every weight is W(t) = Proj(MLP(Sinusoidal(t))), the hypernetworks
  stored stacked (`qkvflow.models.per_weight` holds the layout before stacking).
* `SharedGenerator` (weight-shared N-ODE Transformer, Baier-Reinio & De Sterck, 2020): constant
  weights; time enters only as a bias c * t added to the output of every affine map.
"""

from dataclasses import dataclass
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray

from qkvflow.models.per_weight import PerWeightGenerator
from qkvflow.models.weight_spec import WeightSpec, matrix_std
from qkvflow.nn.projection import project_stacked
from qkvflow.nn.random import normal
from qkvflow.nn.time_dependent import TimeDependentWeight, TimeEmbed, TimeMLP
from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding

STACK = "stacked"
"""The leading axis of a stack of hypernetworks (time MLPs or projections)."""


@dataclass(frozen=True)
class Group:
    """Weights with the same named shape and kind, whose projections form one stacked array."""

    key: str  # the members' names joined by "+": the group's name in the parameter tree
    names: tuple[str, ...]
    kind: str

    @property
    def mlp(self) -> str:
        """Which stack of time MLPs makes this group's embeddings: one for matrices, one for the rest
        (they differ in weight decay, `qkvflow.training.adam`, so they stay separate arrays)."""
        return "matrix" if self.kind == "matrix" else "vector"


def stack_groups(specs: dict[str, WeightSpec]) -> tuple[Group, ...]:
    """The specs grouped by (named shape, kind), groups and members in the specs' order."""
    groups: dict = {}
    for name, spec in specs.items():
        groups.setdefault((spec.axes, spec.kind), []).append(name)
    return tuple(Group("+".join(names), tuple(names), kind) for (_, kind), names in groups.items())


def _stack(modules: list):
    """One module whose named arrays gain a leading STACK axis (the modules' static parts are equal)."""
    Stack = Axis(STACK, len(modules))
    return jax.tree_util.tree_map(lambda *xs: hax.stack(Stack, xs), *modules, is_leaf=hax.is_named_array)


def _unstack(module, i: int):
    return jax.tree_util.tree_map(lambda x: x[STACK, i], module, is_leaf=hax.is_named_array)


class HyperGenerator(eqx.Module):
    """The DiffEqFormer's weights as functions of depth: W(t) = Proj(MLP(Sinusoidal(t))) for every named weight.

    One sinusoidal embedding of t is shared. Each weight has its own time MLP (or one shared MLP,
    `shared_time_mlp`) and its own projection to the weight's shape (`qkvflow.nn.time_dependent`), but
    they are stored stacked, as Levanter stacks a transformer's layers: the time MLPs of all matrices in
    one stack and those of all biases and norm scales in another (`mlps`), and the projections of the
    weights of one named shape and kind in one array (`projections`, e.g. q, k and v together). One
    batched product per stack then makes all its weights at all requested times, and the optimizer
    updates a few large arrays instead of many small ones. The math is the per-weight generator's
    (`qkvflow.models.per_weight`, the layout before stacking), row by row.
    Calling it at t gives the dict of named arrays one field evaluation reads.
    """

    time_embedding: SinusoidalTimeEmbedding
    shared_mlp: Optional[TimeMLP]
    mlps: Optional[dict[str, TimeMLP]]  # "matrix" / "vector": leaves [stacked, ...]
    projections: dict[str, NamedArray]  # group key -> [stacked, time_embed, *target axes]
    groups: tuple[Group, ...] = eqx.field(static=True)
    names: tuple[str, ...] = eqx.field(static=True)
    normalise: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(specs: dict[str, WeightSpec], config, *, key) -> "HyperGenerator":
        """`config` supplies num_frequencies, time_scale, time_max_period, time_embed_dim, shared_time_mlp,
        time_embed_norm, initializer_range and matrix_init.

        Matrices start with W(t) ~ N(0, std^2) at every t (the projection is rescaled by the
        measured size of its time embedding), std = initializer_range or, with matrix_init
        "fan_in", 1/sqrt(fan_in); biases start at 0 and norm scales at 1. Every weight is initialised
        as in the per-weight layout, with the same keys, then stacked: the arrays are bit-identical.
        """
        return HyperGenerator.from_per_weight(PerWeightGenerator.init(specs, config, key=key), specs)

    @staticmethod
    def from_per_weight(generator, specs: dict[str, WeightSpec]) -> "HyperGenerator":
        """The per-weight layout (`qkvflow.models.per_weight.PerWeightGenerator`) stacked."""
        groups = stack_groups(specs)
        weights = generator.weights
        mlps = None
        if generator.shared_mlp is None:
            mlps = {}
            for stack in ("matrix", "vector"):
                members = [weights[n].mlp for g in groups if g.mlp == stack for n in g.names]
                if members:
                    mlps[stack] = _stack(members)
        projections = {g.key: _stack([weights[n].proj for n in g.names]) for g in groups}
        normalise = next(iter(weights.values())).normalise
        return HyperGenerator(
            generator.time_embedding, generator.shared_mlp, mlps, projections, groups, tuple(specs), normalise
        )

    def per_weight(self):
        """The same generator in the per-weight layout (what checkpoints before stacking hold)."""
        return PerWeightGenerator(self.time_embedding, self.shared_mlp, self.weights)

    @property
    def weights(self) -> dict[str, TimeDependentWeight]:
        """Each weight's own hypernetwork, sliced out of the stacks (a view, for analysis and conversion)."""
        out = {}
        for group, rows in zip(self.groups, self._mlp_rows(), strict=True):
            for i, name in enumerate(group.names):
                mlp = None if self.mlps is None else _unstack(self.mlps[group.mlp], rows.start + i)
                offset = 1.0 if group.kind == "norm" else 0.0
                out[name] = TimeDependentWeight(mlp, self.projections[group.key][STACK, i], offset, self.normalise)
        return {name: out[name] for name in self.names}

    def _mlp_rows(self) -> list[slice]:
        """Each group's rows in its stack of time MLPs (groups are contiguous, in order)."""
        rows, used = [], {"matrix": 0, "vector": 0}
        for g in self.groups:
            rows.append(slice(used[g.mlp], used[g.mlp] + len(g.names)))
            used[g.mlp] += len(g.names)
        return rows

    def _stacked(self, s: NamedArray) -> dict[str, NamedArray]:
        """W at the time features `s` ((time_feature,) or (*times, time_feature)) as stacks, one per group
        ([stacked, *times, *target]): per stack of time MLPs one batched MLP, then per group one batched
        projection."""
        if self.mlps is None:
            shared = self.shared_mlp(s)
            embeddings = {"matrix": shared, "vector": shared}
        else:
            embeddings = {k: hax.vmap(TimeMLP.__call__, STACK)(mlp, s) for k, mlp in self.mlps.items()}
        out = {}
        for group, rows in zip(self.groups, self._mlp_rows(), strict=True):
            e = embeddings[group.mlp]
            proj = self.projections[group.key]
            e = hax.broadcast_axis(e, proj.resolve_axis(STACK)) if self.mlps is None else e[STACK, rows]
            e = hnn.silu(e)
            if self.normalise:
                e = e * hax.rsqrt(hax.mean(hax.square(e), TimeEmbed) + 1e-6)
            w = project_stacked(e / proj.resolve_axis(TimeEmbed).size, proj, TimeEmbed, STACK)
            out[group.key] = w + 1.0 if group.kind == "norm" else w
        return out

    def split(self, stacks: dict[str, NamedArray]) -> dict[str, NamedArray]:
        """The named weights of `stacks` (as `stacked_at_times` or a row of it gives them)."""
        out = {name: stacks[g.key][STACK, i] for g in self.groups for i, name in enumerate(g.names)}
        return {name: out[name] for name in self.names}

    def __call__(self, t) -> dict[str, NamedArray]:
        return self.split(self._stacked(self.time_embedding(t)))

    def at_times(self, times: NamedArray) -> dict[str, NamedArray]:
        """W(t_k) for every t_k of the 1-d `times`: each weight gains the axis of `times`.

        The time features are computed per t; each stack's products then run over all times and all
        its members at once (and their gradients likewise).
        """
        return self.split(self.stacked_at_times(times))

    def stacked_at_times(self, times: NamedArray) -> dict[str, NamedArray]:
        """`at_times` before `split`: one array per group, [stacked, times, *target]. A solve that looks
        its weights up in this table reads (and, differentiated, accumulates into) one array per group."""
        (Times,) = times.axes
        return self._stacked(hax.vmap(self.time_embedding, Times)(times))


class SharedGenerator(eqx.Module):
    constants: dict[str, NamedArray]
    time_bias: dict[str, NamedArray]  # one c per matrix, over the matrix's output axes

    @staticmethod
    def init(specs: dict[str, WeightSpec], config, *, key) -> "SharedGenerator":
        keys = jrandom.split(key, len(specs))
        constants, time_bias = {}, {}
        for k, (name, spec) in zip(keys, specs.items()):
            if spec.kind == "matrix":
                constants[name] = normal(k, spec.axes) * matrix_std(spec, config)
                time_bias[name] = hax.zeros(spec.out_axes)
            elif spec.kind == "norm":
                constants[name] = hax.ones(spec.axes)
            else:
                constants[name] = hax.zeros(spec.axes)
        return SharedGenerator(constants, time_bias)

    def __call__(self, t) -> dict[str, NamedArray]:
        t = t.array if isinstance(t, NamedArray) else jnp.asarray(t)
        weights = dict(self.constants)
        for name, c in self.time_bias.items():
            bias = c * t.astype(c.dtype)
            if f"{name}_bias" in weights:
                bias = weights[f"{name}_bias"] + bias
            weights[f"{name}_bias"] = bias
        return weights

    def at_times(self, times: NamedArray) -> dict[str, NamedArray]:
        """W(t_k) for every t_k of the 1-d `times`: each weight gains the axis of `times`."""
        (Times,) = times.axes
        return hax.vmap(self, Times)(times)
