"""The N-ODE Transformer (Baier-Reinio & De Sterck, 2020) as a causal language model: `model: {type:
node_transformer}`, trained by `qkvflow train` and scored by `qkvflow eval` like every other family.

The field, the blocks and the readout are `qkvflow.models.related.node_transformer`'s (the PARITY model's),
applied to each sequence of the batch separately (`jax.vmap`, so solver steps and NFE are per sequence):

    X_1(0) = E[tokens] + P                                  (embedding + sinusoidal positions)
    X_i(0) = X_{i-1}(1),   X'(t) = FFN_t(alpha X + MHSA_t(X))   (eq. 4, causal attention)
    every affine map x A + b + c t (eq. 5; attention time-independent unless `time_attention`)
    no LayerNorm, no dropout, d/2 heads of size 2, FFN d -> d -> d
    logits = relu(X_N(1) H1 + h1) H2                          (the paper's two-layer readout, per token)
    loss   = next-token CE + lambda / 2 * mean_seq (1/L) sum_blocks int_0^1 ||X'(t)||_F^2 dt   (eq. 6)

Each block is solved by `qkvflow.integrate.integrate` with an adaptive solver (tsit5 by default, or
dopri5), rtol = atol = 1e-5. The kinetic term and the solver's NFE and steps reach the training loss and
metrics through `qkvflow.training.loss.lm_loss` (`train/ode_*`).

Differences from the paper's encoder: causal attention, a readout on every token, and no output bias h2
(Levanter's LM head is a matrix, `get_lm_head`). Sequences are full-length LM chunks, so there is no
padding; the attention mask is the one Levanter gives (materialised). The family is declared `ode=False`
in the registry: that flag means a DiffEqFormer-style `ode:` solver block (grids in `qkvflow eval`,
discretisation, export), which this model does not have; its solver keys are its own.

Parameters are the PARITY model's dict, each array named (vocab, embed_in, embed axes) so that Levanter
shards and restores them like any other model's; the math runs on their raw arrays (`raw_params`), as
diffrax does, and Haliax named arrays are the `LmHeadModel` boundary (token ids in, activations and the
LM head out).
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional, Type

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmConfig, LmHeadModel

from qkvflow.errors import check
from qkvflow.integrate.solve import OdeStats
from qkvflow.models.flavour import GPT2
from qkvflow.models.registry import register
from qkvflow.models.related.node_transformer import NodeTransformerConfig, embed, encode, head_hidden, init


@register("node_transformer", flavour=GPT2, ode=False)
@dataclass(frozen=True)
class NodeTransformerLmConfig(LmConfig):
    """The N-ODE Transformer as a causal LM; defaults are the paper's (d = 8, N = 2, alpha = 1, tsit5 at
    rtol = atol = 1e-5). `kinetic_weight` is the lambda of eq. 6 (0: off)."""

    max_seq_len: int = 64
    hidden_dim: int = 8
    num_blocks: int = 2
    alpha: int = 1
    time_attention: bool = False
    solver: str = "tsit5"
    rtol: float = 1e-5
    atol: float = 1e-5
    max_steps: int = 512
    kinetic_weight: float = 0.0

    def __post_init__(self):
        check(self.max_seq_len >= 1, "model.max_seq_len", self.max_seq_len, "an integer >= 1")
        check(self.kinetic_weight >= 0, "model.kinetic_weight", self.kinetic_weight, "a float >= 0")
        check(self.max_steps >= 1, "model.max_steps", self.max_steps, "an integer >= 1")
        _ = self.node  # the field's own checks (hidden_dim, num_blocks, alpha, solver, rtol, atol)

    @property
    def node(self) -> NodeTransformerConfig:
        """The field's configuration: the PARITY model's, causal, as an ODE."""
        return NodeTransformerConfig(
            hidden_dim=self.hidden_dim,
            num_blocks=self.num_blocks,
            alpha=self.alpha,
            time_attention=self.time_attention,
            ode=True,
            causal=True,
            max_len=self.max_seq_len,
            solver=self.solver,
            rtol=self.rtol,
            atol=self.atol,
            max_steps=self.max_steps,
            kinetic_lambda=self.kinetic_weight,
        )

    Embed = property(lambda self: Axis("embed", self.hidden_dim))

    @property
    def model_type(self) -> Type["NodeTransformerLMHeadModel"]:
        return NodeTransformerLMHeadModel


class NodeTransformerLMHeadModel(LmHeadModel[NodeTransformerLmConfig]):
    """N chained ODE blocks over each sequence; `flow` also gives the kinetic energy and solver statistics."""

    _config: NodeTransformerLmConfig = eqx.field(static=True)
    _Vocab: Axis = eqx.field(static=True)
    params: dict
    """`node_transformer.init`'s arrays, named: embed (vocab, embed), every A (embed_in, embed) but head2's
    (embed_in, vocab), every b and c (embed,)."""

    @property
    def config(self) -> NodeTransformerLmConfig:
        return self._config

    @property
    def Vocab(self) -> Axis:
        return self._Vocab

    @classmethod
    def init(cls, Vocab: Axis, config: NodeTransformerLmConfig, *, key) -> "NodeTransformerLMHeadModel":
        params = init(dataclasses.replace(config.node, num_classes=Vocab.size), key, vocab=Vocab.size)
        params["head2"] = {"A": params["head2"]["A"]}  # no output bias: an LM head is a matrix
        Embed, EmbedIn = config.Embed, config.Embed.alias("embed_in")

        def name(path, array):
            keys = [getattr(k, "key", None) for k in path]
            if keys[0] == "embed":
                return hax.named(array, (Vocab, Embed))
            if array.ndim == 2:
                return hax.named(array, (EmbedIn, Vocab if keys[0] == "head2" else Embed))
            return hax.named(array, (Embed,))

        return cls(config, Vocab, jax.tree_util.tree_map_with_path(name, params))

    @property
    def raw_params(self) -> dict:
        """The parameters as `node_transformer`'s functions take them: a dict of raw arrays."""
        return jax.tree_util.tree_map(lambda a: a.array, self.params, is_leaf=hax.is_named_array)

    def flow(
        self, input_ids: NamedArray, attn_mask: Optional[AttentionMask | NamedArray] = None
    ) -> tuple[NamedArray, jnp.ndarray, OdeStats]:
        """(relu(X_N(1) H1 + h1) over input_ids' axes + embed, mean over sequences of
        (1/L) sum_blocks int ||X'||_F^2 dt, OdeStats of NFE and steps per sequence averaged over the batch)."""
        config = self.config
        node = config.node
        Pos = input_ids.resolve_axis(config.max_Pos.name)
        KeyPos = Pos.alias(config.KeyPos.name)
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        if isinstance(mask, AttentionMask):
            mask = mask.materialize(Pos, KeyPos)
        batch = tuple(ax for ax in input_ids.axes if ax.name != Pos.name)
        n = Pos.size
        tokens = input_ids.rearrange((*batch, Pos)).array.reshape(-1, n)
        masks = hax.broadcast_to(mask, (*batch, Pos, KeyPos)).array.reshape(-1, n, n).astype(bool)

        params = self.raw_params

        def one(tok, m):
            x, energy, nfe, steps = encode(params["blocks"], embed(params, tok, node), m, jnp.ones(n), node)
            return head_hidden(params, x), energy / n, nfe, steps

        hidden, energy, nfe, steps = jax.vmap(one)(tokens, masks)
        out = hax.named(hidden.reshape(*(ax.size for ax in batch), n, config.hidden_dim), (*batch, Pos, config.Embed))
        stats = OdeStats(num_steps=jnp.mean(steps.astype(jnp.float32)), nfe=jnp.mean(nfe.astype(jnp.float32)))
        return out, jnp.mean(energy), stats

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        key=None,
        pos_ids: Optional[NamedArray] = None,
    ) -> NamedArray:
        """The readout's hidden layer relu(X_N(1) H1 + h1); positions are the fixed sinusoids (pos_ids unused)."""
        return self.flow(input_ids, attn_mask)[0]

    def get_lm_head(self) -> NamedArray:
        return self.params["head2"]["A"].rename({"embed_in": "embed"})

    def resize_vocab(self, new_size: int, key=None) -> "NodeTransformerLMHeadModel":
        k_emb, k_head = jrandom.split(key if key is not None else jrandom.PRNGKey(0))
        embed_w = hax.tree_util.resize_axis(self.params["embed"], "vocab", new_size, key=k_emb)
        head = hax.tree_util.resize_axis(self.params["head2"]["A"], "vocab", new_size, key=k_head)
        params = {**self.params, "embed": embed_w, "head2": {"A": head}}
        return dataclasses.replace(self, _Vocab=self.Vocab.resize(new_size), params=params)
