"""The DiffEqFormer language model, read top to bottom:

    x(0) = embed(tokens) [+ learned positions, GPT-2 flavour]
    x(1) = x(0) + int_0^1 F(W(t), x(t)) dt          (diffrax; W from the generator)
    logits = norm(x(1)) @ unembedding

It implements Levanter's `LmHeadModel`, so Levanter's trainer, evaluator and loss use it as they
use a GPT-2. `flow` also returns the kinetic energy and solver statistics; qkvflow's training loss
(`qkvflow.training.loss`) adds the kinetic penalty and logs the evaluations, while evaluation sees the plain
language-model loss.
"""

import dataclasses
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel

from qkvflow.integrate.solve import OdeStats, integrate
from qkvflow.integrate.weight_source import WeightSource
from qkvflow.models.config import DiffEqFormerConfig
from qkvflow.models.fields import FIELDS
from qkvflow.models.generator import HyperGenerator, SharedGenerator

GENERATORS = {"hyper": HyperGenerator, "shared": SharedGenerator}


class DiffEqFormerLMHeadModel(LmHeadModel[DiffEqFormerConfig]):
    _config: DiffEqFormerConfig = eqx.field(static=True)
    _Vocab: Axis = eqx.field(static=True)
    token_embeddings: hnn.Embedding
    position_embeddings: Optional[hnn.Embedding]
    generator: eqx.Module
    final_norm: hnn.LayerNorm | hnn.RmsNorm
    lm_head: Optional[NamedArray]  # [embed, vocab] when not tied to the token embeddings

    @property
    def config(self) -> DiffEqFormerConfig:
        return self._config

    @property
    def Vocab(self) -> Axis:
        return self._Vocab

    @property
    def field(self):
        return FIELDS[self._config.flavour]

    @classmethod
    def init(cls, Vocab: Axis, config: DiffEqFormerConfig, *, key) -> "DiffEqFormerLMHeadModel":
        k_tok, k_pos, k_gen, k_head = jrandom.split(key, 4)
        Embed, std = config.Embed, config.initializer_range
        tokens = hnn.Embedding.init(Vocab, Embed, key=k_tok, initializer_range=std)
        positions = None
        if config.flavour == "gpt2":
            positions = hnn.Embedding.init(config.max_Pos, Embed, key=k_pos, initializer_range=std / 2)
        specs = FIELDS[config.flavour].weight_specs(config)
        generator = GENERATORS[config.generator].init(specs, config, key=k_gen)
        if config.flavour == "gpt2":
            final_norm = hnn.LayerNorm.init(Embed, eps=config.layer_norm_epsilon, use_bias=True)
        else:
            final_norm = hnn.RmsNorm.init(Embed, eps=config.layer_norm_epsilon, use_bias=False)
        lm_head = None if config.tied_embeddings else hax.random.normal(k_head, (Embed, Vocab)) * std
        return cls(config, Vocab, tokens, positions, generator, final_norm, lm_head)

    def embed(self, input_ids: NamedArray, pos_ids: Optional[NamedArray] = None) -> NamedArray:
        x = self.token_embeddings(input_ids)
        if self.position_embeddings is not None:
            if pos_ids is None:
                pos_ids = hax.arange(input_ids.resolve_axis(self.Pos.name), dtype=jnp.int32)
            x = x + self.position_embeddings.embed(pos_ids)
        return x

    def flow(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        pos_ids: Optional[NamedArray] = None,
    ) -> tuple[NamedArray, Optional[jnp.ndarray], OdeStats]:
        """x(1) before the final norm, the kinetic energy (None when off) and solver statistics.

        A missing mask means causal: the model is a language model.
        """
        config = self._config
        if attn_mask is None:
            attn_mask = AttentionMask.causal()
        if pos_ids is None:
            pos_ids = hax.arange(input_ids.resolve_axis(self.Pos.name), dtype=jnp.int32)
        x0 = self.embed(input_ids, pos_ids)
        axes, field = x0.axes, self.field

        def vector_field(t, y, args):
            source, mask, pos = args
            x = hax.named(y, axes)
            dx = field.vector_field(source(t), x, config=config, mask=mask, pos_ids=pos)
            return dx.rearrange(axes).array.astype(y.dtype)

        source = WeightSource.build(self.generator, config.ode)
        tokens = x0.size // config.hidden_dim if config.kinetic_weight > 0 else None
        y1, energy, stats = integrate(vector_field, x0.array, (source, attn_mask, pos_ids), config.ode, tokens=tokens)
        return hax.named(y1, axes), energy, stats

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        key=None,
        pos_ids: Optional[NamedArray] = None,
    ):
        x, _, _ = self.flow(input_ids, attn_mask, pos_ids=pos_ids)
        return self.final_norm(x)

    def get_lm_head(self) -> NamedArray:
        return self.token_embeddings.weight if self.lm_head is None else self.lm_head

    def resize_vocab(self, new_size: int, key=None) -> "DiffEqFormerLMHeadModel":
        k_emb, k_head = jrandom.split(key if key is not None else jrandom.PRNGKey(0))
        lm_head = self.lm_head
        if lm_head is not None:
            lm_head = hax.tree_util.resize_axis(lm_head, self.Vocab.name, new_size, key=k_head)
        return dataclasses.replace(
            self,
            _Vocab=self.Vocab.resize(new_size),
            token_embeddings=self.token_embeddings.resize_embeddings(new_size, key=k_emb),
            lm_head=lm_head,
        )
