"""The parallel block: attention and feed-forward read the same x, each through its own pre-norm,

    x <- x + o_proj(Attn(attn_norm(x))) + mlp(mlp_norm(x)),

which is one Euler step x + dt F(W(t_k), x) of a DiffEqFormer field once dt is folded into o_proj
and the feed-forward's output projection. Every projection is an `haliax.nn.Linear`, so Levanter's
`loraize` can wrap it; field names are the Hugging Face module names of `qkvflow.export.hf`.

Attention is computed as in `qkvflow.models.fields.common.self_attention` (Levanter's
`dot_product_attention`, scale 1/sqrt(head_size), Levanter's half-split rotary for Llama).

Every `config` here is a `qkvflow.models.discrete.model.ParallelConfig`; it is annotated as Levanter's
`LmConfig` so that the layers do not import the model module that builds them from these layers.
"""

from typing import Callable, Optional

import equinox as eqx
import haliax.nn as hnn
import jax.random as jrandom
from haliax import NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmConfig

from qkvflow.models.fields.common import attend

from .schemes import STAGES, RkGate, init_scheme_parameters, rk_step, stage_list


def make_norm(config: LmConfig, weight=None, bias=None) -> hnn.LayerNorm | hnn.RmsNorm:
    """The flavour's pre-norm: LayerNorm (GPT-2) or float32 RMSNorm (Llama), as the ODE fields use."""
    return config.flavour_spec.norm(config.Embed, config.layer_norm_epsilon, weight, bias)


class ParallelAttention(eqx.Module):
    config: LmConfig = eqx.field(static=True)
    q_proj: hnn.Linear  # embed -> (heads, head_size)
    k_proj: hnn.Linear
    v_proj: hnn.Linear
    o_proj: hnn.Linear  # (heads, head_size) -> embed

    @staticmethod
    def init(config: LmConfig, *, key) -> "ParallelAttention":
        Embed, Qkv, bias = config.Embed, (config.Heads, config.HeadSize), config.has_attention_bias
        kq, kk, kv, ko = jrandom.split(key, 4)
        q = hnn.Linear.init(Embed, Qkv, key=kq, use_bias=bias)
        k = hnn.Linear.init(Embed, Qkv, key=kk, use_bias=bias)
        v = hnn.Linear.init(Embed, Qkv, key=kv, use_bias=bias)
        o = hnn.Linear.init(Qkv, Embed, key=ko, use_bias=bias)
        return ParallelAttention(config, q, k, v, o)

    def __call__(self, h: NamedArray, mask, pos_ids: NamedArray, attend_fn=None) -> NamedArray:
        """`attend_fn` replaces `attend` as in `qkvflow.models.fields.common.self_attention`."""
        config = self.config
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if config.flavour_spec.rotary:
            rotary = config.rope.build(config.HeadSize)
            q, k = rotary(q, pos_ids), rotary(k, pos_ids)
        out = (attend_fn or attend)(q, k, v, config, mask)
        return self.o_proj(out.astype(h.dtype))


class Gpt2Mlp(eqx.Module):
    """down_proj(act(up_proj(m)))."""

    up_proj: hnn.Linear
    down_proj: hnn.Linear
    act: Callable = eqx.field(static=True)

    @staticmethod
    def init(config: LmConfig, *, key) -> "Gpt2Mlp":
        k_up, k_down = jrandom.split(key)
        bias = config.has_mlp_bias
        up = hnn.Linear.init(config.Embed, config.Mlp, key=k_up, use_bias=bias)
        down = hnn.Linear.init(config.Mlp, config.Embed, key=k_down, use_bias=bias)
        return Gpt2Mlp(up, down, config.activation_function.to_fn())

    def __call__(self, m: NamedArray) -> NamedArray:
        return self.down_proj(self.act(self.up_proj(m)))


class SwiGluMlp(eqx.Module):
    """down_proj(silu(gate_proj(m)) * up_proj(m))."""

    gate_proj: hnn.Linear
    up_proj: hnn.Linear
    down_proj: hnn.Linear

    @staticmethod
    def init(config: LmConfig, *, key) -> "SwiGluMlp":
        kg, ku, kd = jrandom.split(key, 3)
        bias = config.has_mlp_bias
        gate = hnn.Linear.init(config.Embed, config.Mlp, key=kg, use_bias=bias)
        up = hnn.Linear.init(config.Embed, config.Mlp, key=ku, use_bias=bias)
        down = hnn.Linear.init(config.Mlp, config.Embed, key=kd, use_bias=bias)
        return SwiGluMlp(gate, up, down)

    def __call__(self, m: NamedArray) -> NamedArray:
        return self.down_proj(hnn.silu(self.gate_proj(m)) * self.up_proj(m))


def mlp_class(config: LmConfig) -> type:
    """The flavour's feed-forward module: SwiGLU when it is gated, act(up) down otherwise."""
    return SwiGluMlp if config.flavour_spec.gated_mlp else Gpt2Mlp


def make_mlp(config: LmConfig, projections: dict) -> "Gpt2Mlp | SwiGluMlp":
    """The feed-forward module holding `projections` ({module name: hnn.Linear}, e.g. up_proj, down_proj)."""
    if config.flavour_spec.gated_mlp:
        return SwiGluMlp(**projections)
    return Gpt2Mlp(**projections, act=config.activation_function.to_fn())


class ParallelBlock(eqx.Module):
    """One layer: x + F(x) with F(x) = o_proj(Attn(attn_norm(x))) + mlp(mlp_norm(x)), or one Runge-Kutta
    step of F under the config's `block_scheme` (`qkvflow.models.discrete.schemes`; `gamma` and `gate`
    are the learned coefficients of rk2_scalar and rk2_gated, None for the other schemes).

    With a sequential config (`sequential_gpt2`) F is the whole sequential pre-norm layer's increment,
    F(x) = a + mlp(mlp_norm(x + a)) with a = o_proj(Attn(attn_norm(x))), so that x + F(x) is GPT-2's
    x' = x + Attn(LN1(x)), x'' = x' + MLP(LN2(x'))."""

    attn_norm: hnn.LayerNorm | hnn.RmsNorm
    self_attn: ParallelAttention
    mlp_norm: hnn.LayerNorm | hnn.RmsNorm
    mlp: Gpt2Mlp | SwiGluMlp
    gamma: Optional[NamedArray] = None
    gate: Optional[RkGate] = None

    @staticmethod
    def init(config: LmConfig, *, key) -> "ParallelBlock":
        k_attn, k_mlp, k_scheme = jrandom.split(key, 3)
        attn = ParallelAttention.init(config, key=k_attn)
        mlp = mlp_class(config).init(config, key=k_mlp)
        gamma, gate = init_scheme_parameters(config.block_scheme, config.Embed, config.initializer_range, key=k_scheme)
        return ParallelBlock(make_norm(config), attn, make_norm(config), mlp, gamma, gate)

    def increment(self, x: NamedArray, mask, pos_ids: NamedArray, attend_fn=None) -> NamedArray:
        """F(x): the attention and feed-forward branches, each through its own pre-norm; a sequential
        layer's feed-forward reads x + the attention branch instead of x."""
        a = self.self_attn(self.attn_norm(x), mask, pos_ids, attend_fn)
        if self.self_attn.config.sequential:
            return a + self.mlp(self.mlp_norm(x + a))
        return a + self.mlp(self.mlp_norm(x))

    def __call__(
        self, x: NamedArray, mask: Optional[AttentionMask | NamedArray], pos_ids: NamedArray, attend_fn=None
    ) -> NamedArray:
        """`attend_fn`: one function for every stage, or a sequence of one per stage (a decoder's caches)."""
        scheme = self.self_attn.config.block_scheme
        attends = stage_list(attend_fn, STAGES[scheme])
        return rk_step(
            scheme, lambda y, stage: self.increment(y, mask, pos_ids, attends[stage]), x, self.gamma, self.gate
        )
