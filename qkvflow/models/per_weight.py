"""The hypernetwork layout of qkvflow before stacking: one `TimeDependentWeight` per named weight.

Checkpoints and ODE exports (format version 2) written before the stacked `HyperGenerator` hold this
layout, `generator.weights.<name>.{proj, mlp.lin{1,2}.{weight,bias}}`. It computes the same W(t) as the
stacked generator, one small product per weight; `HyperGenerator.from_per_weight` converts it (the
arrays are stacked, not changed), `HyperGenerator.per_weight()` converts back. `qkvflow.models.layout` uses both to read and write
the previous layout.
"""

import dataclasses
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import NamedArray

from qkvflow.models.weight_spec import matrix_std
from qkvflow.nn.time_dependent import TimeDependentWeight, TimeMLP
from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding


class PerWeightGenerator(eqx.Module):
    """W(t) = Proj(MLP(Sinusoidal(t))) for every named weight, each weight with its own time MLP (or one
    shared MLP, `shared_time_mlp`) and its own projection (`qkvflow.nn.time_dependent`)."""

    time_embedding: SinusoidalTimeEmbedding
    shared_mlp: Optional[TimeMLP]
    weights: dict[str, TimeDependentWeight]

    @staticmethod
    def init(specs: dict, config, *, key) -> "PerWeightGenerator":
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
        generator = PerWeightGenerator(embedding, shared_mlp, weights)
        return generator._normalise_init(specs)

    def _normalise_init(self, specs) -> "PerWeightGenerator":
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
