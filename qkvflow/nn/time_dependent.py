"""A weight that is a function of time: W(t) = offset + Proj(silu(MLP(Sinusoidal(t)))) / d_emb.

    MLP(s) = L2(silu(L1(s)))        L1: time_feature -> time_hidden, L2: time_hidden -> time_embed
    Proj(e) = sum_d e_d P[d, ...]   P: time_embed x (target axes), no bias

(DiffEqFormer, Tong et al., ICLR 2025, Sec. 3.) The silu before Proj keeps L2 and Proj from
collapsing into one linear map. `offset` is 1 for norm scales (so W(0) is near the identity) and 0
otherwise. The MLP may be owned by this weight (the paper's default) or shared by all weights
(its ablation); then the caller passes the shared embedding in.

The fixed multiplier 1/d_emb (an output multiplier in the sense of muP, Yang et al., 2021) sets how
fast Adam moves W(t). Adam changes every entry of P by about the learning rate, and the entries of
dP = e g^T for one entry of W share the sign of e_d g, so W moves by about lr * sum_d |e_d|. Without
the multiplier that is d_emb * mean|e| times an ordinary weight's step (about 10x at d_emb 64, see
tests/nn/test_time_dependent.py), and at nanoGPT's learning rate the DiffEqFormer stalled on Tiny
Shakespeare (benchmarks/README.md). With it, W(t) moves by about lr * mean|e| for any d_emb. The
initialisation compensates, so W(t) starts with the same spread either way.

`normalise=True` (config `time_embed_norm`) divides e = silu(MLP(s)) by its RMS over d_emb before
Proj, so mean|e| is about 0.8 whatever the MLP does. silu(MLP(s)) starts with mean|e| of about 0.15
(silu halves the small pre-activations of the default init), so without it Proj's share of an Adam
step moves W(t) by about 0.15 lr, a sixth of an ordinary weight's step; with it, by about 0.8 lr.
The time MLP's own step comes on top (tests/nn/test_time_dependent.py measures the total).
"""

from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray

from qkvflow.nn.projection import project
from qkvflow.nn.random import normal

TimeHidden = "time_hidden"
TimeEmbed = "time_embed"


class TimeMLP(eqx.Module):
    """e(t) = L2(silu(L1(s(t)))), both layers of width d_emb."""

    lin1: hnn.Linear
    lin2: hnn.Linear

    @staticmethod
    def init(TimeFeature: Axis, time_embed_dim: int, *, key) -> "TimeMLP":
        k1, k2 = jrandom.split(key)
        Hidden, Embed = Axis(TimeHidden, time_embed_dim), Axis(TimeEmbed, time_embed_dim)
        return TimeMLP(hnn.Linear.init(TimeFeature, Hidden, key=k1), hnn.Linear.init(Hidden, Embed, key=k2))

    def __call__(self, features: NamedArray) -> NamedArray:
        features = features.astype(self.lin1.weight.dtype)
        return self.lin2(hnn.silu(self.lin1(features)))


class TimeDependentWeight(eqx.Module):
    """One generated tensor with the named axes `proj.axes[1:]`."""

    mlp: Optional[TimeMLP]
    proj: NamedArray  # [time_embed, *target axes]
    offset: float = eqx.field(static=True, default=0.0)
    normalise: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(
        target: tuple[Axis, ...],
        TimeFeature: Axis,
        time_embed_dim: int,
        *,
        std: float,
        own_mlp: bool,
        offset: float = 0.0,
        normalise: bool = False,
        key,
    ) -> "TimeDependentWeight":
        """Proj starts as N(0, 1) * std * sqrt(d_emb), so W(t) has std `std` when silu(MLP) has unit
        RMS; the generator then rescales it by the measured RMS."""
        k_mlp, k_proj = jrandom.split(key)
        mlp = TimeMLP.init(TimeFeature, time_embed_dim, key=k_mlp) if own_mlp else None
        Embed = Axis(TimeEmbed, time_embed_dim)
        if std == 0.0:
            proj = hax.zeros((Embed, *target))
        else:
            proj = normal(k_proj, (Embed, *target)) * (std * jnp.sqrt(time_embed_dim))
        return TimeDependentWeight(mlp, proj, offset, normalise)

    def embed(self, features: NamedArray, shared: Optional[NamedArray]) -> NamedArray:
        return self.mlp(features) if self.mlp is not None else shared

    def coefficients(self, features: NamedArray, shared: Optional[NamedArray] = None) -> NamedArray:
        """e(t) = silu(MLP(s(t))), divided by its RMS over time_embed when `normalise`."""
        e = hnn.silu(self.embed(features, shared))
        if self.normalise:
            e = e * hax.rsqrt(hax.mean(hax.square(e), TimeEmbed) + 1e-6)
        return e

    def __call__(self, features: NamedArray, shared: Optional[NamedArray] = None) -> NamedArray:
        """features: (time_feature,) for one t, or (*times, time_feature) for several at once."""
        e = self.coefficients(features, shared)
        w = project(e / self.proj.resolve_axis(TimeEmbed).size, self.proj, TimeEmbed)
        return w + self.offset if self.offset else w
