"""Weight generators: t -> the named weights of one transformer layer.

A generator is the only place time enters the model. The vector field (`qkvflow.models.fields`)
reads whatever dict of named arrays a generator returns, so the DiffEqFormer and its baselines
differ only here:

* `HyperGenerator` (DiffEqFormer): every weight is W(t) = Proj(MLP(Sinusoidal(t))).
* `SharedGenerator` (weight-shared N-ODE Transformer, Baier-Reinio & De Sterck, 2020): constant
  weights; time enters only as a bias c * t added to the output of every affine map.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray

from qkvflow.nn.random import normal
from qkvflow.nn.time_dependent import TimeDependentWeight, TimeMLP
from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding


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


class HyperGenerator(eqx.Module):
    """The DiffEqFormer's weights as functions of depth: W(t) = Proj(MLP(Sinusoidal(t))) for every named weight.

    One sinusoidal embedding of t is shared; each weight has its own time MLP (or one shared MLP,
    `shared_time_mlp`) and its own projection to the weight's shape (`qkvflow.nn.time_dependent`).
    Calling it at t gives the dict of named arrays one field evaluation reads.
    """

    time_embedding: SinusoidalTimeEmbedding
    shared_mlp: Optional[TimeMLP]
    weights: dict[str, TimeDependentWeight]

    @staticmethod
    def init(specs: dict[str, WeightSpec], config, *, key) -> "HyperGenerator":
        """`config` supplies num_frequencies, time_scale, time_max_period, time_embed_dim, shared_time_mlp,
        time_embed_norm, initializer_range and matrix_init.

        Matrices start with W(t) ~ N(0, std^2) at every t (the projection is rescaled by the
        measured size of its time embedding), std = initializer_range or, with matrix_init
        "fan_in", 1/sqrt(fan_in); biases start at 0 and norm scales at 1.
        """
        embedding = SinusoidalTimeEmbedding.init(config.num_frequencies, config.time_scale, config.time_max_period)
        k_shared, *keys = jrandom.split(key, len(specs) + 1)
        d = config.time_embed_dim
        own = not config.shared_time_mlp
        shared_mlp = None if own else TimeMLP.init(embedding.TimeFeature, d, key=k_shared)
        weights = {}
        for k, (name, spec) in zip(keys, specs.items()):
            std = matrix_std(spec, config) if spec.kind == "matrix" else 0.0
            offset = 1.0 if spec.kind == "norm" else 0.0
            weights[name] = TimeDependentWeight.init(
                spec.axes,
                embedding.TimeFeature,
                d,
                std=std,
                own_mlp=own,
                offset=offset,
                normalise=config.time_embed_norm,
                key=k,
            )
        generator = HyperGenerator(embedding, shared_mlp, weights)
        return generator._normalise_init(specs)

    def _normalise_init(self, specs) -> "HyperGenerator":
        times = jnp.linspace(0.0, 1.0, 9)
        weights = dict(self.weights)
        for name, spec in specs.items():
            if spec.kind != "matrix":
                continue
            w = weights[name]
            e = jax.vmap(lambda t: w.coefficients(*self._features(t)).array)(times)  # noqa: B023 (called here)
            rms = jnp.sqrt(jnp.mean(jnp.square(e)))
            weights[name] = dataclasses.replace(w, proj=w.proj / rms)
        return dataclasses.replace(self, weights=weights)

    def _features(self, t) -> tuple[NamedArray, Optional[NamedArray]]:
        s = self.time_embedding(t)
        return s, (self.shared_mlp(s) if self.shared_mlp is not None else None)

    def __call__(self, t) -> dict[str, NamedArray]:
        s, shared = self._features(t)
        return {name: w(s, shared) for name, w in self.weights.items()}

    def at_times(self, times: NamedArray) -> dict[str, NamedArray]:
        """W(t_k) for every t_k of the 1-d `times`: each weight gains the axis of `times`.

        The time features are computed per t; each projection is then one matrix product over all
        times (and its gradient another), rather than one product per t.
        """
        (Times,) = times.axes
        s = hax.vmap(self.time_embedding, Times)(times)
        shared = self.shared_mlp(s) if self.shared_mlp is not None else None
        return {name: w(s, shared) for name, w in self.weights.items()}


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
