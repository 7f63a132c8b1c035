"""Sinusoidal features of the ODE time t.

    Sinusoidal(t) = concat(t, sin(w * s t), cos(w * s t)),   w_i = exp(-ln(P) * i / F),  i = 0..F-1

with F frequencies (128 by default), maximum period P = 1e4 (the transformer positional-encoding
constant of Vaswani et al., 2017) and a time scale s.

Why the scale: depth time lives in [0, 1], while the frequencies span [1/P, 1] rad per unit. With
s = 1 every sin(w t) would be almost linear on [0, 1] and the features would barely tell two layers
apart. s = 1000 (the value used by the DiffEqFormer reference code, and the range of diffusion-model
timesteps the embedding comes from) makes the fastest feature turn about 160 times over [0, 1] and
the slowest ones stay smooth, so the hypernetwork sees both coarse and fine time information.
The raw t is kept unscaled as the first feature.
"""

import math

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import Axis, NamedArray


class SinusoidalTimeEmbedding(eqx.Module):
    """Maps a scalar time t to `TimeFeature` = 2F + 1 features (computed in float32)."""

    Frequencies: Axis = eqx.field(static=True)
    time_scale: float = eqx.field(static=True, default=1000.0)
    max_period: float = eqx.field(static=True, default=1e4)

    @staticmethod
    def init(num_frequencies: int = 128, time_scale: float = 1000.0, max_period: float = 1e4):
        return SinusoidalTimeEmbedding(Axis("time_freq", num_frequencies), time_scale, max_period)

    @property
    def TimeFeature(self) -> Axis:
        return Axis("time_feature", 2 * self.Frequencies.size + 1)

    def __call__(self, t) -> NamedArray:
        """t: a scalar (array or 0-d NamedArray, as hax.vmap passes it)."""
        t = jnp.asarray(t.array if isinstance(t, NamedArray) else t, dtype=jnp.float32)
        i = jnp.arange(self.Frequencies.size, dtype=jnp.float32)
        w = jnp.exp(-math.log(self.max_period) * i / self.Frequencies.size)
        angle = self.time_scale * t * w
        features = jnp.concatenate([t[None], jnp.sin(angle), jnp.cos(angle)])
        return hax.named(features, self.TimeFeature)
