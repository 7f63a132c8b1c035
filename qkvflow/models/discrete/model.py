"""The discrete parallel-block language model (Levanter `LmHeadModel`):

    x_0 = embed_tokens(tokens) [+ embed_positions(pos), GPT-2 flavour]
    x_{k+1} = x_k + o_proj_k(Attn_k(attn_norm_k(x_k))) + mlp_k(mlp_norm_k(x_k)),   k = 0..L-1
    logits = norm(x_L) @ unembedding

The blocks are stacked with `haliax.nn.Stacked` over a `layers` axis. Module names mirror the
torch modules of `qkvflow.export.hf.modeling_qkvflow`, so `haliax.state_dict.to_torch_compatible_state_dict`
of this model (and Levanter's `save_peft_pretrained` of a LoRA on it, with prefix
"base_model.model") gives the torch state dict:

    model.embed_tokens.weight, model.embed_positions.weight (GPT-2), model.norm.{weight,bias},
    model.layers.{i}.{attn_norm,mlp_norm}.{weight,bias}, model.layers.{i}.self_attn.{q,k,v,o}_proj.*,
    model.layers.{i}.mlp.{gate_proj (Llama),up_proj,down_proj}.*, lm_head.weight (untied only)
"""

import dataclasses
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from haliax.nn.scan import Stacked
from haliax.state_dict import ModuleWithStateDictSerialization
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel

from .config import ParallelConfig
from .layers import ParallelBlock, make_norm


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
        if config.flavour == "gpt2":
            positions = hnn.Embedding.init(config.max_Pos, config.Embed, key=k_pos, initializer_range=std / 2)
        layers = Stacked.init(config.Layers, ParallelBlock, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jrandom.split(k_layers, config.num_layers)
        )
        return ParallelTransformer(config, tokens, positions, layers, make_norm(config))

    def __call__(self, input_ids: NamedArray, mask, pos_ids: Optional[NamedArray]) -> NamedArray:
        if pos_ids is None:
            pos_ids = hax.arange(input_ids.resolve_axis(self.config.max_Pos.name), dtype=jnp.int32)
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions.embed(pos_ids)
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
