"""The discrete parallel-block language model and its configs (Levanter `LmConfig` / `LmHeadModel`):

    x_0 = embed_tokens(tokens) [+ embed_positions(pos), GPT-2 flavour]
    x_{k+1} = x_k + o_proj_k(Attn_k(attn_norm_k(x_k))) + mlp_k(mlp_norm_k(x_k)),   k = 0..L-1
    logits = norm(x_L) @ unembedding

(with `block_scheme` other than euler, each layer is one Runge-Kutta step of that increment instead:
`qkvflow.models.discrete.schemes`)

| type            | norm      | feed-forward          | positions           |
|-----------------|-----------|-----------------------|---------------------|
| parallel_gpt2   | LayerNorm | act(x W_up) W_down    | learned, absolute   |
| parallel_llama  | RMSNorm   | SwiGLU (gate, up)     | rotary (half-split) |
| sequential_gpt2 | LayerNorm | act(x W_up) W_down    | learned, absolute   |

`sequential_gpt2` is Levanter's GPT-2 layer order instead of the parallel block: a = o_proj(Attn(attn_norm(x))),
x_{k+1} = x + a + mlp(mlp_norm(x + a)); it exists so that the Runge-Kutta `block_scheme`s apply to a
sequential baseline too, every stage running the whole sequential layer (the ODE Transformer's setting).

Each of the `num_layers` blocks is one Euler step of a DiffEqFormer's field; `qkvflow.models.discretise`
builds one from an ODE checkpoint, and Levanter's trainer can also train one from scratch
(`model: {type: parallel_gpt2, ...}`).

The blocks are stacked with `haliax.nn.Stacked` over a `layers` axis. Module names mirror the
torch modules of `qkvflow.export.hf.modeling_qkvflow`, so `haliax.state_dict.to_torch_compatible_state_dict`
of this model (and Levanter's `save_peft_pretrained` of a LoRA on it, with prefix
"base_model.model") gives the torch state dict:

    model.embed_tokens.weight, model.embed_positions.weight (GPT-2), model.norm.{weight,bias},
    model.layers.{i}.{attn_norm,mlp_norm}.{weight,bias}, model.layers.{i}.self_attn.{q,k,v,o}_proj.*,
    model.layers.{i}.mlp.{gate_proj (Llama),up_proj,down_proj}.*, lm_head.weight (untied only)
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional, Type

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from haliax.nn.scan import Stacked
from haliax.state_dict import ModuleWithStateDictSerialization
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig, RotaryEmbeddingsConfig
from levanter.models.lm_model import LmConfig, LmHeadModel
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.errors import check as _check
from qkvflow.models.flavour import GPT2, LLAMA, Flavour
from qkvflow.models.registry import register

from .layers import ParallelBlock, make_norm
from .schemes import BLOCK_SCHEMES, STAGES


@dataclass(frozen=True)
class ParallelConfig(LmConfig):
    """A stack of `num_layers` parallel blocks; the block design is the class's flavour (`flavour_spec`),
    declared with the family in `qkvflow.models.registry`."""

    flavour: ClassVar[str] = "gpt2"
    flavour_spec: ClassVar[Flavour] = GPT2
    sequential: ClassVar[bool] = False
    """The layer's increment: parallel branches (False) or attention then feed-forward (`sequential_gpt2`)."""

    max_seq_len: int = 1024
    hidden_dim: int = 768
    num_heads: int = 12
    num_layers: int = 12
    intermediate_dim: Optional[int] = None
    """None: 4 * hidden_dim (GPT-2), or 8/3 * hidden_dim rounded up to 64 (Llama), as the ODE models."""
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.gelu_new
    """Feed-forward nonlinearity of the GPT-2 flavour (the Llama flavour's gate is always silu)."""
    attention_bias: Optional[bool] = None
    """Biases on q, k, v and o. None: True for GPT-2, False for Llama."""
    mlp_bias: Optional[bool] = None
    """Biases on the feed-forward projections. None: True for GPT-2, False for Llama."""
    tie_word_embeddings: Optional[bool] = None
    """None: True for GPT-2, False for Llama."""
    rope: RotaryEmbeddingsConfig = dataclasses.field(default_factory=DefaultRotaryEmbeddingsConfig)
    """Rotary positions (Llama flavour only)."""
    attn_backend: Optional[AttentionBackend] = None
    flash_attention_block_size: Optional[int] = None
    gradient_checkpointing: bool = True
    block_scheme: str = "euler"
    """How a layer applies its increment F: `euler` (x + F(x), the discretised DiffEqFormer) or one
    Runge-Kutta step with shared weights, `rk2 | rk2_unit | rk2_scalar | rk2_gated | rk4` (the ODE
    Transformer; `qkvflow.models.discrete.schemes`). Only `euler` exports, fine-tunes and discretises."""

    def __post_init__(self):
        _check(self.block_scheme in BLOCK_SCHEMES, "block_scheme", self.block_scheme, f"one of {list(BLOCK_SCHEMES)}")
        for name in ("max_seq_len", "hidden_dim", "num_heads", "num_layers"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        divides = self.hidden_dim % self.num_heads == 0
        _check(divides, "num_heads", self.num_heads, f"a divisor of hidden_dim={self.hidden_dim}")
        if self.intermediate_dim is not None:
            _check(self.intermediate_dim >= 1, "intermediate_dim", self.intermediate_dim, "null or an integer >= 1")

    # --- flavour-dependent defaults (the same rules as DiffEqFormerConfig) -----------------------
    @property
    def mlp_dim(self) -> int:
        return self.flavour_spec.mlp_dim(self.hidden_dim, self.intermediate_dim)

    has_attention_bias = property(lambda self: _default(self.attention_bias, self.flavour_spec.biases))
    has_mlp_bias = property(lambda self: _default(self.mlp_bias, self.flavour_spec.biases))
    tied_embeddings = property(lambda self: _default(self.tie_word_embeddings, self.flavour_spec.tied_embeddings))

    # --- named axes: the same names as the ODE models', so weights move between them by name ------
    # (positions: Levanter's `max_Pos` and `KeyPos`)
    Embed = property(lambda self: Axis("embed", self.hidden_dim))
    Heads = property(lambda self: Axis("heads", self.num_heads))
    HeadSize = property(lambda self: Axis("head_size", self.hidden_dim // self.num_heads))
    Mlp = property(lambda self: Axis("mlp", self.mlp_dim))
    Layers = property(lambda self: Axis("layers", self.num_layers))

    @property
    def model_type(self) -> Type:
        return ParallelLMHeadModel

    def flops_per_token(self, vocab_size: int, context_length: int) -> Optional[float]:
        from levanter.utils.flop_utils import lm_flops_per_token

        # every stage of a Runge-Kutta block runs the whole layer; the gate adds 2 x 2 x hidden per layer
        gate = 4.0 * self.hidden_dim * self.num_layers if self.block_scheme == "rk2_gated" else 0.0
        return gate + lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.mlp_dim,
            num_layers=self.num_layers * STAGES[self.block_scheme],
            num_kv_heads=self.num_heads,
            num_heads=self.num_heads,
            seq_len=context_length,
            vocab_size=vocab_size,
            glu=self.flavour_spec.gated_mlp,
        )


def _default(value: Optional[bool], flavour_default: bool) -> bool:
    return flavour_default if value is None else value


@register("parallel_gpt2", flavour=GPT2, ode=False)
@dataclass(frozen=True)
class ParallelGpt2Config(ParallelConfig):
    """Parallel blocks of the GPT-2 flavour (what a diffeqformer_gpt2 / shared_ode_gpt2 discretises to)."""


@register("parallel_llama", flavour=LLAMA, ode=False)
@dataclass(frozen=True)
class ParallelLlamaConfig(ParallelConfig):
    """Parallel blocks of the Llama flavour, with Llama's eps and gate."""

    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.silu
    layer_norm_epsilon: float = 1e-6


@register("sequential_gpt2", flavour=GPT2, ode=False)
@dataclass(frozen=True)
class SequentialGpt2Config(ParallelConfig):
    """GPT-2's sequential pre-norm layer (attention sublayer, then feed-forward sublayer, each residual) with
    `block_scheme`: each Runge-Kutta stage runs the whole sequential layer on that layer's weights. Levanter's
    own `gpt2` computes the same euler layer; this family is for the schemes (it does not export)."""

    sequential: ClassVar[bool] = True


class ParallelTransformer(ModuleWithStateDictSerialization):
    config: ParallelConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    embed_positions: Optional[hnn.Embedding]
    layers: Stacked[ParallelBlock]
    norm: hnn.LayerNorm | hnn.RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: ParallelConfig, *, key) -> "ParallelTransformer":
        k_tok, k_pos, k_layers = jrandom.split(key, 3)
        std = config.initializer_range
        tokens = hnn.Embedding.init(Vocab, config.Embed, key=k_tok, initializer_range=std)
        positions = None
        if config.flavour_spec.learned_positions:
            positions = hnn.Embedding.init(config.max_Pos, config.Embed, key=k_pos, initializer_range=std / 2)
        layers = Stacked.init(config.Layers, ParallelBlock, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jrandom.split(k_layers, config.num_layers)
        )
        return ParallelTransformer(config, tokens, positions, layers, make_norm(config))

    def embed(self, input_ids: NamedArray, pos_ids: Optional[NamedArray]) -> tuple[NamedArray, NamedArray]:
        """(x_0, pos_ids): the token embeddings [+ learned positions], and the positions (0.. when None)."""
        if pos_ids is None:
            pos_ids = hax.arange(input_ids.resolve_axis(self.config.max_Pos.name), dtype=jnp.int32)
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions.embed(pos_ids)
        return x, pos_ids

    def __call__(self, input_ids: NamedArray, mask, pos_ids: Optional[NamedArray]) -> NamedArray:
        x, pos_ids = self.embed(input_ids, pos_ids)
        x = self.layers.fold(x, mask, pos_ids)
        return self.norm(x)


class ParallelLMHeadModel(ModuleWithStateDictSerialization, LmHeadModel[ParallelConfig]):
    model: ParallelTransformer
    lm_head: Optional[hnn.Linear]  # embed -> vocab; None when tied to the token embeddings

    @property
    def config(self) -> ParallelConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    @classmethod
    def init(cls, Vocab: Axis, config: ParallelConfig, *, key) -> "ParallelLMHeadModel":
        k_model, k_head = jrandom.split(key)
        lm_head = None
        if not config.tied_embeddings:
            lm_head = hnn.Linear.init(config.Embed, Vocab, key=k_head, use_bias=False)
        return cls(ParallelTransformer.init(Vocab, config, key=k_model), lm_head)

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        key=None,
        pos_ids: Optional[NamedArray] = None,
    ) -> NamedArray:
        """norm(x_L). A missing mask means causal: the model is a language model."""
        return self.model(input_ids, AttentionMask.causal() if attn_mask is None else attn_mask, pos_ids)

    def get_lm_head(self) -> NamedArray:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def resize_vocab(self, new_size: int, key=None) -> "ParallelLMHeadModel":
        k_emb, k_head = jrandom.split(key if key is not None else jrandom.PRNGKey(0))
        model = dataclasses.replace(
            self.model, embed_tokens=self.model.embed_tokens.resize_embeddings(new_size, key=k_emb)
        )
        lm_head = self.lm_head
        if lm_head is not None:
            weight = hax.tree_util.resize_axis(lm_head.weight, self.Vocab.name, new_size, key=k_head)
            lm_head = dataclasses.replace(lm_head, weight=weight, Out=self.Vocab.resize(new_size))
        return dataclasses.replace(self, model=model, lm_head=lm_head)
