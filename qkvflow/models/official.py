"""`variant: official`: the weight generator of the DiffEqFormer's official code (SDML-KU/qkvflow).

Read from that repository's `qkvflow/nn/dynamic.py` (`TemporalLinear`, `TemporalLayerNorm`,
`NeuralOdeTransformer`) and `qkvflow/nn/time_embed.py` (`SinusoidalPosEmb`), commit a3f1547. One time
MLP per linear or norm module of the GPT-2 block, e = L2(silu(L1(Sinusoidal(t)))), no activation after
L2 and no 1/d_emb, and from it

    linear module (c_attn: q, k, v together; c_proj; c_fc; c_proj of the MLP):
        W(t) = e P + P0          (a Linear from d_emb to the weight's axes, with its bias P0)
        b(t) = e B               (B: d_emb x output axes, no bias; starts at N(0, 1e-8))
    norm module (attn_ln, mlp_ln):
        scale(t) = e S + 1,  shift(t) = e H      (S, H: d_emb x embed, both start at 0)

With `use_bias: false` the official code drops B (`TemporalLinear`, dynamic.py lines 76-81), the norms'
shift H (`TemporalLayerNorm`, lines 160-163, given `use_bias` by `Block.init`, lines 383-399) and the
final LayerNorm's bias (`ln_f`, lines 526-528), and keeps P0 (`f_W` always has its bias, lines 69-74)
and the norms' scale S. This generator and `final_norm` below do the same; the GPT-2 field then
normalises without a shift. (qkvflow's own variant keeps the norm shifts whatever `use_bias` says.)

The sinusoids' maximum period is the config's `time_max_period` (P in w_i = exp(-ln(P) i / F)). The
official code always uses its default, 1e4 (`SinusoidalPosEmb.__call__`, time_embed.py line 18, called
without it at dynamic.py line 540), which is also the config's default.

Everything else is qkvflow's: the sinusoidal features are the same [t, sin(1000 w t), cos(1000 w t)],
the GPT-2 field is the same parallel pre-norm block, and the official Euler loop's weights at
t_k = (k + 1) / N are the generator's `time_grid = "right"` (qkvflow.integrate.weight_source).
The weight dict it returns has qkvflow's names, so the field, discretisation, export, LoRA and the
KV-cache decoder read it unchanged. Initialisation follows the official code (haliax's Linear:
truncated normal with std 1/sqrt(fan_in), zero bias). The official Llama differs in its field as well
(the feed-forward's norm is applied to the attention norm's output; q, k, v have separate modules);
it is not built here.
"""

from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.random as jrandom
from haliax import Axis, NamedArray

from qkvflow.nn.random import normal
from qkvflow.nn.time_dependent import TimeEmbed, TimeMLP
from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding

Qkv = Axis("qkv", 3)
QKV = ("q", "k", "v")


class OfficialModule(eqx.Module):
    """One official temporal module: its time MLP and the maps from e(t) to its weights."""

    names: tuple[str, ...] = eqx.field(static=True)  # matrix or norm name(s); q, k, v stacked on `qkv`
    kind: str = eqx.field(static=True)  # "matrix" or "norm"
    mlp: TimeMLP
    weight: hnn.Linear | NamedArray  # matrix: Linear(time_embed -> weight axes); norm: S [time_embed, embed]
    bias: Optional[NamedArray]  # B or H [time_embed, output axes]

    def __call__(self, s: NamedArray) -> dict[str, NamedArray]:
        e = self.mlp(s)
        if self.kind == "norm":
            (name,) = self.names
            out = {name: hax.dot(e, self.weight, axis=TimeEmbed) + 1.0}
            if self.bias is not None:
                out[f"{name}_bias"] = hax.dot(e, self.bias, axis=TimeEmbed)
            return out
        w = self.weight(e)
        b = None if self.bias is None else hax.dot(e, self.bias, axis=TimeEmbed)
        if len(self.names) == 1:
            return {self.names[0]: w} | ({} if b is None else {f"{self.names[0]}_bias": b})
        out = {name: w[Qkv, i] for i, name in enumerate(self.names)}
        return out | ({} if b is None else {f"{name}_bias": b[Qkv, i] for i, name in enumerate(self.names)})


def _module(names, specs, TimeFeature, d: int, norm_shift: bool, *, key) -> OfficialModule:
    k_mlp, k_proj = jrandom.split(key)
    mlp = TimeMLP.init(TimeFeature, d, key=k_mlp)
    Embed = Axis(TimeEmbed, d)
    spec = specs[names[0]]
    has_bias = f"{names[0]}_bias" in specs
    if spec.kind == "norm":
        bias = hax.zeros((Embed, *spec.out_axes)) if has_bias and norm_shift else None
        return OfficialModule(names, "norm", mlp, hax.zeros((Embed, *spec.out_axes)), bias)
    out = spec.out_axes if len(names) == 1 else (Qkv, *spec.out_axes)
    weight = hnn.Linear.init(Embed, (*spec.in_axes, *out), key=k_proj, use_bias=True, out_first=False)
    bias = normal(k_proj, (Embed, *out)) * 1e-4 if has_bias else None  # the official key reuse
    return OfficialModule(names, "matrix", mlp, weight, bias)


def final_norm(config) -> hnn.LayerNorm:
    """The official `ln_f`: a LayerNorm whose bias exists only with `use_bias` (dynamic.py lines 526-528)."""
    return hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=config.bias)


class OfficialGenerator(eqx.Module):
    """t -> the GPT-2 block's weights, one official temporal module per linear/norm (module docstring)."""

    time_embedding: SinusoidalTimeEmbedding
    modules: dict[str, OfficialModule]
    time_grid: str = eqx.field(static=True, default="right")

    @staticmethod
    def init(specs: dict, config, *, key) -> "OfficialGenerator":
        embedding = SinusoidalTimeEmbedding.init(config.num_frequencies, config.time_scale, config.time_max_period)
        groups = [QKV] if set(QKV) <= specs.keys() else []
        groups += [(n,) for n, s in specs.items() if s.kind in ("matrix", "norm") and n not in QKV]
        keys = jrandom.split(key, len(groups))
        modules = {
            "_".join(g) if len(g) > 1 else g[0]: _module(
                g, specs, embedding.TimeFeature, config.time_embed_dim, config.bias, key=k
            )
            for g, k in zip(groups, keys)
        }
        return OfficialGenerator(embedding, modules, config.resolved_time_grid)

    def __call__(self, t) -> dict[str, NamedArray]:
        s = self.time_embedding(t)
        return {k: v for m in self.modules.values() for k, v in m(s).items()}

    def at_times(self, times: NamedArray) -> dict[str, NamedArray]:
        """W(t_k) for every t_k of the 1-d `times`: each weight gains the axis of `times`."""
        (Times,) = times.axes
        s = hax.vmap(self.time_embedding, Times)(times)
        return {k: v for m in self.modules.values() for k, v in m(s).items()}
