"""TransEvolve (Dutta et al., NeurIPS 2021, "Redesigning the Transformer Architecture with Insights
from Multi-particle Dynamical Systems") as a causal language model, `model: {type: transevolve_gpt2}`.

The model is `num_blocks` blocks of L = num_layers / num_blocks layers. A block computes its queries
and keys ONCE, from its input X^0 (after a LayerNorm, `qk_norm`), through maps over [X^0, T^l]:

    q^l_i = LN(X^0)_i W_Q + b_Q + T^l W_QT,        k^l_j = LN(X^0)_j W_K + b_K + T^l W_KT,

per head, where T^l (l = 0..L-1, shared by all tokens) is the depth vector

    T^l_c = a_c sin(pi l c / P)  (c even),    T^l_c = a_c cos(pi l c / P)  (c odd),

with learned amplitudes a (one per block and feature c) and P = `depth_period` (64, the authors').
The attention logits of layer l (paper Eq. 6, scaled by 1/sqrt(head_size) as usual) are

    q^l_i . k^l_j = A0_ij + (A1 T)_i + (T A2)_j + T A3 T,
    A0 = Q0 K0^T,  (A1 T)_i = q0_i . (T W_KT),  (T A2)_j = (T W_QT) . k0_j,  T A3 T = (T W_QT) . (T W_KT),

with Q0 = LN(X^0) W_Q + b_Q and K0 = LN(X^0) W_K + b_K. The attention is a softmax over the key
index j within a row i, and a row-constant shift c_i cancels in it (also under the causal mask):
exp(s_ij + c_i) / sum_j' exp(s_ij' + c_i) = exp(s_ij) / sum_j' exp(s_ij'). The terms (A1 T)_i and
T A3 T do not depend on j, so

    softmax_j(q^l_i . k^l_j / sqrt(d_h)) = softmax_j((q0_i . k0_j + b^l_j) / sqrt(d_h)),
    b^l_j = (T^l W_QT) . k0_j,

a per-key, per-head bias that changes with depth. It is computed with Levanter's attention kernels
(`levanter.layers.attention.dot_product_attention`, causal mask) by appending a constant 1 to every
query and b^l_j to every key (size head_size + 1, scale 1/sqrt(head_size)): [q0_i, 1] . [k0_j, b^l_j]
= q0_i . k0_j + b^l_j. Consequence: W_KT never enters the forward pass and receives an exactly zero
gradient; it is kept so that the parameterisation (and parameter count) is the paper's, and the
tests compute all four terms from it.

Each layer l of a block, with its own output map W_o^l and no value projection (the values of head h
are head h's slice of the pre-normed X^l):

    H^l     = softmax(a^l) LN_a^l(X^l) W_o^l + b_o^l + X^l,
    X^{l+1} = H^l + FFN^l(LN_m^l(H^l)),                FFN(m) = act(m W_1 + b_1) W_2 + b_2,

and the next block starts from the last layer's output. Norms (all LayerNorms with weight and bias,
eps `layer_norm_epsilon`): `qk_norm` per block on X^0 before the query/key maps; `attn_norm` per
layer on X^l (the values); `mlp_norm` per layer before the feed-forward (GPT-2's pre-norm residual);
a final `norm` before the tied unembedding (logits = norm(X) E^T with E the token embedding).
Token embeddings and learned absolute positions are GPT-2's (std `initializer_range`, positions half).

Feed-forward variants (`ffn`): `full`, GPT-2's per-layer W_1 (hidden x mlp), W_2 (mlp x hidden);
`random`, each matrix W = U diag(sigma) V of rank r = min(fan_in, fan_out), with U (fan_in x r) and
V (r x fan_out) fixed pseudo-random matrices that are NOT parameters: they are generated inside the
forward pass from the static `random_ffn_seed` and the layer's index in the model
(`random_factors`), i.i.d. Gaussian with each factor scaled by 1/sqrt(its own fan_in), so that at
sigma = 1 (the initialisation) W's entries have variance 1/fan_in, as Levanter's default Linear. Only
sigma and the biases train. The paper calls its U, V random rotation matrices (orthogonal); Gaussian
factors are our choice (no QR in the forward pass).

Weight decay: Levanter's default mask (norms, embeddings and `*bias` are spared) decays the q/k/o
maps, the full FFN's matrices, the random FFN's sigma (its weights) and the depth amplitudes a.

Differences from the paper: a decoder-only causal LM (the paper evaluates encoder-decoder translation
and encoder-only tasks), a LayerNorm placement of our choosing as listed above, and l counted from 0.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Type

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from haliax.nn.scan import Stacked
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.models.lm_model import LmConfig, LmHeadModel
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.errors import check
from qkvflow.models.discrete.layers import Gpt2Mlp
from qkvflow.models.flavour import GPT2
from qkvflow.models.registry import register
from qkvflow.nn.attention import dot_product_attention

FFN_KINDS = ("full", "random")


@register("transevolve_gpt2", flavour=GPT2, ode=False)
@dataclass(frozen=True)
class TransEvolveConfig(LmConfig):
    """TransEvolve: `num_blocks` blocks of num_layers / num_blocks layers, attention computed once per
    block and evolved in depth (module docstring); `ffn: full | random`."""

    max_seq_len: int = 1024
    hidden_dim: int = 768
    num_heads: int = 12
    num_layers: int = 12
    """Layers in all, L per block times num_blocks."""
    num_blocks: int = 1
    ffn: str = "full"
    """`full`: a trained FFN per layer; `random`: W = U diag(sigma) V, fixed random U, V, trained sigma and biases."""
    intermediate_dim: Optional[int] = None
    """None: 4 * hidden_dim (GPT-2)."""
    random_ffn_seed: int = 0
    """Seed of the random FFN's fixed U, V (a config value, not a parameter)."""
    depth_period: float = 64.0
    """P in the depth vector's angle pi l c / P."""
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.gelu_new
    attn_backend: Optional[AttentionBackend] = None
    flash_attention_block_size: Optional[int] = None
    gradient_checkpointing: bool = True

    def __post_init__(self):
        for name in ("max_seq_len", "hidden_dim", "num_heads", "num_layers", "num_blocks"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        check(self.hidden_dim % self.num_heads == 0, "num_heads", self.num_heads, f"a divisor of hidden_dim={self.hidden_dim}")  # fmt: skip
        divides = self.num_layers % self.num_blocks == 0
        check(divides, "num_blocks", self.num_blocks, f"a divisor of num_layers={self.num_layers}")
        check(self.ffn in FFN_KINDS, "ffn", self.ffn, f"one of {list(FFN_KINDS)}")
        if self.intermediate_dim is not None:
            check(self.intermediate_dim >= 1, "intermediate_dim", self.intermediate_dim, "null or an integer >= 1")
        check(self.depth_period > 0, "depth_period", self.depth_period, "a number > 0")
        check(self.random_ffn_seed >= 0, "random_ffn_seed", self.random_ffn_seed, "an integer >= 0")

    @property
    def mlp_dim(self) -> int:
        return self.flavour_spec.mlp_dim(self.hidden_dim, self.intermediate_dim)

    has_mlp_bias = property(lambda self: True)  # GPT-2's FFN (qkvflow.models.discrete.layers.Gpt2Mlp)
    layers_per_block = property(lambda self: self.num_layers // self.num_blocks)

    Embed = property(lambda self: Axis("embed", self.hidden_dim))
    Heads = property(lambda self: Axis("heads", self.num_heads))
    HeadSize = property(lambda self: Axis("head_size", self.hidden_dim // self.num_heads))
    QkSize = property(lambda self: Axis("qk_size", self.hidden_dim // self.num_heads + 1))
    Mlp = property(lambda self: Axis("mlp", self.mlp_dim))
    Layers = property(lambda self: Axis("layers", self.layers_per_block))

    @property
    def model_type(self) -> Type:
        return TransEvolveLMHeadModel

    def flops_per_token(self, vocab_size: int, context_length: int) -> Optional[float]:
        """Forward FLOPs per token, counted as Levanter's `lm_flops_per_token` counts (2 per multiply-add,
        the full attention map, 3 per logit for the mask and softmax; elementwise ops and biases left out):
        per block the q, k maps and the key bias; per layer the logits over head_size + 1, the values, the
        output map and the FFN (the random FFN as its four factors); the tied head. T^l W_QT is per layer,
        not per token, and is left out."""
        d, heads, m, n = self.hidden_dim, self.num_heads, self.mlp_dim, context_length
        hs = d // heads
        per_block = 2 * 2 * d * d + 2 * d
        attn = 2 * n * heads * (hs + 1) + 3 * n * heads + 2 * n * d
        if self.ffn == "full":
            ffn = 2 * 2 * d * m
        else:
            r = min(d, m)
            ffn = 2 * (d * r + r * m) + 2 * (m * r + r * d)
        per_layer = attn + 2 * d * d + ffn
        return float(self.num_blocks * per_block + self.num_layers * per_layer + 2 * d * vocab_size)


def depth_vectors(amplitude: NamedArray, Layers: Axis, period: float) -> NamedArray:
    """T^l for l = 0..L-1: (layers, embed), a_c sin(pi l c / P) at even c, a_c cos(pi l c / P) at odd c."""
    (Embed,) = amplitude.axes
    c = hax.arange(Embed).astype(jnp.float32)
    angle = (math.pi / period) * hax.arange(Layers).astype(jnp.float32).broadcast_axis(Embed) * c
    even = hax.arange(Embed) % 2 == 0
    return amplitude * hax.where(even, hax.sin(angle), hax.cos(angle))


def random_factors(config: TransEvolveConfig, layer) -> tuple[jax.Array, ...]:
    """The random FFN's fixed factors of the model's layer number `layer` (0-based over all blocks; may
    be traced): U_1 (hidden, r), V_1 (r, mlp), U_2 (mlp, r), V_2 (r, hidden), r = min(hidden, mlp),
    i.i.d. N(0, 1) / sqrt(the factor's first dimension), from jax.random.PRNGKey(random_ffn_seed)
    folded with `layer` and split in four. Plain arrays computed in the forward pass, never parameters."""
    d, m = config.hidden_dim, config.mlp_dim
    r = min(d, m)
    k1, k2, k3, k4 = jrandom.split(jrandom.fold_in(jrandom.PRNGKey(config.random_ffn_seed), layer), 4)
    shapes = ((k1, d, r), (k2, r, m), (k3, m, r), (k4, r, d))
    return tuple(jrandom.normal(k, (rows, cols), jnp.float32) / math.sqrt(rows) for k, rows, cols in shapes)


class RandomFeedForward(eqx.Module):
    """act(m U_1 diag(sigma_1) V_1 + b_1) U_2 diag(sigma_2) V_2 + b_2 with fixed random U, V
    (`random_factors`); only the sigmas and biases are parameters."""

    config: TransEvolveConfig = eqx.field(static=True)
    up_sigma: NamedArray  # (rank,)
    up_bias: NamedArray  # (mlp,)
    down_sigma: NamedArray  # (rank,)
    down_bias: NamedArray  # (embed,)

    @staticmethod
    def init(config: TransEvolveConfig, *, key=None) -> "RandomFeedForward":
        Rank = Axis("rank", min(config.hidden_dim, config.mlp_dim))
        return RandomFeedForward(config, hax.ones(Rank), hax.zeros(config.Mlp), hax.ones(Rank), hax.zeros(config.Embed))

    def __call__(self, m: NamedArray, layer: NamedArray) -> NamedArray:
        config = self.config
        Embed, Mlp, Rank = config.Embed, config.Mlp, self.up_sigma.axes[0]
        u1, v1, u2, v2 = (
            hax.named(a, axes)
            for a, axes in zip(
                random_factors(config, layer.array),
                ((Embed, Rank), (Rank, Mlp), (Mlp, Rank), (Rank, Embed)),
            )
        )
        h = hax.dot(hax.dot(m, u1, axis=Embed) * self.up_sigma, v1, axis=Rank) + self.up_bias
        h = config.activation_function.to_fn()(h)
        return hax.dot(hax.dot(h, u2, axis=Mlp) * self.down_sigma, v2, axis=Rank) + self.down_bias


def evolved_attention(q0, k0, key_bias, values, config: TransEvolveConfig, mask) -> NamedArray:
    """softmax_j((q0_i . k0_j + b_j) / sqrt(head_size)) values_j by Levanter's attention: q = [q0, 1],
    k = [k0, b] over the `qk_size` axis (head_size + 1)."""
    HeadSize, Pos, KeyPos = config.HeadSize, config.max_Pos, config.KeyPos
    One = HeadSize.resize(1)
    q = hax.concatenate(HeadSize.name, [q0, hax.ones_like(q0[HeadSize.name, 0:1])])
    k = hax.concatenate(HeadSize.name, [k0, key_bias.broadcast_axis(One)])
    q, k = q.rename({HeadSize.name: config.QkSize.name}), k.rename({HeadSize.name: config.QkSize.name})
    k = k.rename({Pos.name: KeyPos.name})
    values = values.rename({Pos.name: KeyPos.name})
    return dot_product_attention(
        Pos.name,
        KeyPos.name,
        config.QkSize.name,
        q,
        k,
        values,
        mask=mask,
        attn_backend=config.attn_backend,
        flash_block_size=config.flash_attention_block_size,
        scaling_factor=1.0 / math.sqrt(HeadSize.size),
    )


class TransEvolveLayer(eqx.Module):
    """One layer: H = softmax(a^l) LN_a(X) W_o + b_o + X, then X' = H + FFN(LN_m(H))."""

    config: TransEvolveConfig = eqx.field(static=True)
    attn_norm: hnn.LayerNorm
    o_proj: hnn.Linear  # (heads, head_size) -> embed
    mlp_norm: hnn.LayerNorm
    mlp: Gpt2Mlp | RandomFeedForward

    @staticmethod
    def init(config: TransEvolveConfig, *, key) -> "TransEvolveLayer":
        k_o, k_mlp = jrandom.split(key)
        o_proj = hnn.Linear.init((config.Heads, config.HeadSize), config.Embed, key=k_o, use_bias=True)
        mlp = Gpt2Mlp.init(config, key=k_mlp) if config.ffn == "full" else RandomFeedForward.init(config)
        return TransEvolveLayer(config, _norm(config), o_proj, _norm(config), mlp)

    def __call__(self, x, q0, k0, key_bias, layer, mask) -> NamedArray:
        config = self.config
        values = self.attn_norm(x).unflatten_axis(config.Embed, (config.Heads, config.HeadSize))
        h = x + self.o_proj(evolved_attention(q0, k0, key_bias, values, config, mask).astype(x.dtype))
        m = self.mlp_norm(h)
        return h + (self.mlp(m, layer) if isinstance(self.mlp, RandomFeedForward) else self.mlp(m))


class TransEvolveBlock(eqx.Module):
    """L layers sharing the queries and keys of the block input (module docstring)."""

    config: TransEvolveConfig = eqx.field(static=True)
    qk_norm: hnn.LayerNorm
    q_proj: hnn.Linear  # embed -> (heads, head_size): W_Q, b_Q
    k_proj: hnn.Linear  # W_K, b_K
    q_depth: hnn.Linear  # W_QT, no bias
    k_depth: hnn.Linear  # W_KT, no bias: cancels in the softmax (zero gradient), kept as the paper's
    depth_amplitude: NamedArray  # a, (embed,)
    layers: Stacked[TransEvolveLayer]

    @staticmethod
    def init(config: TransEvolveConfig, *, key) -> "TransEvolveBlock":
        kq, kk, kqt, kkt, k_layers = jrandom.split(key, 5)
        Embed, Qk = config.Embed, (config.Heads, config.HeadSize)
        layers = Stacked.init(config.Layers, TransEvolveLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jrandom.split(k_layers, config.layers_per_block)
        )
        return TransEvolveBlock(
            config,
            _norm(config),
            hnn.Linear.init(Embed, Qk, key=kq, use_bias=True),
            hnn.Linear.init(Embed, Qk, key=kk, use_bias=True),
            hnn.Linear.init(Embed, Qk, key=kqt, use_bias=False),
            hnn.Linear.init(Embed, Qk, key=kkt, use_bias=False),
            hax.ones(Embed),
            layers,
        )

    def depth_vectors(self) -> NamedArray:
        """T^l, (layers, embed)."""
        return depth_vectors(self.depth_amplitude, self.config.Layers, self.config.depth_period)

    def __call__(self, x0: NamedArray, mask, first_layer: int) -> NamedArray:
        """The block's L layers from its input x0; `first_layer` numbers its layers in the model (random FFN seeds)."""
        config = self.config
        h = self.qk_norm(x0)
        q0, k0 = self.q_proj(h), self.k_proj(h)
        # b^l_j = (T^l W_QT) . k0_j per head: (layers, heads, ..., position)
        key_bias = hax.dot(self.q_depth(self.depth_vectors()), k0, axis=config.HeadSize)
        layer_ids = hax.arange(config.Layers) + first_layer
        return self.layers.fold(x0, q0, k0, key_bias, layer_ids, mask)


def _norm(config: TransEvolveConfig) -> hnn.LayerNorm:
    return hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=True)


class TransEvolveLMHeadModel(LmHeadModel[TransEvolveConfig]):
    """Embeddings (+ learned positions) -> blocks -> final LayerNorm -> tied unembedding."""

    _config: TransEvolveConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    embed_positions: hnn.Embedding
    blocks: tuple[TransEvolveBlock, ...]
    norm: hnn.LayerNorm

    @property
    def config(self) -> TransEvolveConfig:
        return self._config

    @property
    def Vocab(self) -> Axis:
        return self.embed_tokens.Vocab

    @classmethod
    def init(cls, Vocab: Axis, config: TransEvolveConfig, *, key) -> "TransEvolveLMHeadModel":
        k_tok, k_pos, k_blocks = jrandom.split(key, 3)
        std = config.initializer_range
        tokens = hnn.Embedding.init(Vocab, config.Embed, key=k_tok, initializer_range=std)
        positions = hnn.Embedding.init(config.max_Pos, config.Embed, key=k_pos, initializer_range=std / 2)
        blocks = tuple(TransEvolveBlock.init(config, key=k) for k in jrandom.split(k_blocks, config.num_blocks))
        return cls(config, tokens, positions, blocks, _norm(config))

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        key=None,
        pos_ids: Optional[NamedArray] = None,
    ) -> NamedArray:
        """norm(X) after the last block. A missing mask means causal: the model is a language model."""
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        if pos_ids is None:
            pos_ids = hax.arange(input_ids.resolve_axis(self.config.max_Pos.name), dtype=jnp.int32)
        x = self.embed_tokens(input_ids) + self.embed_positions.embed(pos_ids)
        for b, block in enumerate(self.blocks):
            x = block(x, mask, b * self.config.layers_per_block)
        return self.norm(x)

    def get_lm_head(self) -> NamedArray:
        return self.embed_tokens.weight  # tied

    def resize_vocab(self, new_size: int, key=None) -> "TransEvolveLMHeadModel":
        key = key if key is not None else jrandom.PRNGKey(0)
        return dataclasses.replace(self, embed_tokens=self.embed_tokens.resize_embeddings(new_size, key=key))
