"""The DiffEqFormer language model and its configs, read top to bottom:

    x(0) = embed(tokens) [+ learned positions, GPT-2 flavour]
    x(1) = x(0) + int_0^1 F(W(t), x(t)) dt          (diffrax; W from the generator)
    logits = norm(x(1)) @ unembedding

The configs are declared as model families (`qkvflow.models.registry.register`, which also registers
them with Levanter), so that YAML `model: {type: ...}` selects them:

| type                 | field | weights                                   |
|----------------------|-------|-------------------------------------------|
| diffeqformer_gpt2    | gpt2  | hypernetwork W(t) (DiffEqFormer)          |
| diffeqformer_llama   | llama | hypernetwork W(t)                         |
| shared_ode_gpt2      | gpt2  | constant W, plus c*t bias (N-ODE Transf.) |
| shared_ode_llama     | llama | constant W, plus c*t bias                 |

Levanter's own `gpt2` and `llama` configs are the discrete baselines.

The model implements Levanter's `LmHeadModel`, so Levanter's trainer, evaluator and loss use it as they
use a GPT-2. `flow` also returns the kinetic energy and solver statistics; qkvflow's training loss
(`qkvflow.training.loss`) adds the kinetic penalty and logs the evaluations, while evaluation sees the
plain language-model loss.

This module runs past 400 lines on purpose: the config, its families, the field and the model read as
one page from top to bottom, as nanoGPT's model.py does; the parts they use live in their own modules.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional, Type

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig, RotaryEmbeddingsConfig
from levanter.models.lm_model import LmConfig, LmHeadModel
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.errors import check as _check
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import OdeStats, integrate
from qkvflow.integrate.weight_source import WeightSource
from qkvflow.models.accounting import forward_flops_per_token
from qkvflow.models.depth_dial import DepthDialConfig
from qkvflow.models.fields.dropout import dropout, time_key
from qkvflow.models.flavour import GPT2, LLAMA, Flavour
from qkvflow.models.generator import HyperGenerator, SharedGenerator
from qkvflow.models.official import OfficialGenerator
from qkvflow.models.official import final_norm as official_final_norm
from qkvflow.models.registry import register
from qkvflow.nn.random import normal

EXITS = ("none", "aligned")


@dataclass(frozen=True)
class DiffEqFormerConfig(LmConfig):
    """A continuous-depth transformer: the hidden state solves dx/dt = F(W(t), x) on t in [0, 1].

    The fields below size the blocks and the generator of W(t) and set the solve (`ode`); the block
    design (norm, feed-forward, positions) is the class's flavour, declared with the family in
    `qkvflow.models.registry` (`flavour` is its name, `flavour_spec` the `Flavour`). Which generator
    makes W(t) is the class's `generator`: "hyper" (a hypernetwork per weight, the DiffEqFormer of
    Tong et al. 2025) or "shared" (constant W plus c * t biases).
    """

    flavour: ClassVar[str] = "gpt2"
    flavour_spec: ClassVar[Flavour] = GPT2
    generator: ClassVar[str] = "hyper"

    max_seq_len: int = 1024
    hidden_dim: int = 768
    num_heads: int = 12
    intermediate_dim: Optional[int] = None
    """Feed-forward width; None: 4 * hidden_dim (GPT-2), or SwiGLU's 8/3 * hidden_dim rounded up to 64 (Llama)."""

    time_embed_dim: int = 64
    """d_emb, width of each weight's time MLP; the projections hold d_emb times the layer's parameters."""
    num_frequencies: int = 128
    time_scale: float = 1000.0
    """t is multiplied by this before the sinusoids (see qkvflow.nn.time_embedding). At 1000 the fastest
    feature has period 2 pi / 1000 ~ 0.006 in t, far finer than any solver grid; 2 pi / time_scale is the
    shortest period W(t) can follow (set it with the grids the model is trained and used on in mind)."""
    time_max_period: float = 1e4
    """P, the slowest sinusoid's period in units of time_scale * t (frequencies exp(-ln(P) i / F))."""
    shared_time_mlp: bool = False
    """One time MLP shared by all weights (the paper's ablation) instead of one per weight."""
    time_embed_norm: bool = False
    """Divide silu(MLP(s(t))) by its RMS before Proj, so Proj's share of an Adam step on W(t) is about
    0.8 lr instead of about 0.15 lr (qkvflow.nn.time_dependent; benchmarks/README.md, "Quality")."""

    variant: str = "qkvflow"
    """"official": the hypernetworks of the authors' code (SDML-KU/qkvflow; qkvflow.models.official), GPT-2 flavour."""
    time_grid: Optional[str] = None
    """W of Euler step k at t_k = k/N ("left") or (k+1)/N ("right", the official code's loop; variant official only).
    None: the variant's (left for qkvflow, right for official)."""

    ode: OdeConfig = dataclasses.field(default_factory=OdeConfig)
    kinetic_weight: float = 0.0
    """lambda of the kinetic regulariser lambda/2 * int mean_tokens ||dx/dt||^2 dt; 0 turns it off."""
    dial: DepthDialConfig = dataclasses.field(default_factory=DepthDialConfig)
    """Training recipes for a depth chosen when the model runs (varied grids, consistency, Jacobian
    regulariser; `qkvflow.models.depth_dial`); all off by default."""
    exits: str = "none"
    """"aligned": train on the mean next-token loss of N exits, norm(x(k/N)) @ unembedding for
    k = 1..N (depth-adaptive exits in continuous depth, `qkvflow.models.related.ode_exits`); fixed grids only.
    "none": the loss at t = 1 alone."""

    embed_pdrop: float = 0.0
    """Dropout on x(0), the embedded tokens (+ positions), in training steps only (Levanter GPT-2's name)."""
    resid_pdrop: float = 0.0
    """Dropout on each branch of the field, dx/dt = D_a(t) Attn + D_m(t) FFN, masks drawn per solver time
    t, in training steps only (qkvflow.models.fields.dropout); fixed-step solvers only."""

    initializer_range: float = 0.02
    matrix_init: str = "normal"
    """"normal": generated matrices start with std initializer_range; "fan_in": 1/sqrt(fan_in), as
    the Linear layers of Levanter's GPT-2 and Llama baselines."""
    layer_norm_epsilon: float = 1e-5
    use_bias: Optional[bool] = None
    """None: True for GPT-2, False for Llama. False with variant official also drops the norms' shifts and
    the final norm's bias, as the authors' code does (qkvflow.models.official)."""
    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.gelu_new
    tie_word_embeddings: Optional[bool] = None
    """None: True for GPT-2, False for Llama."""
    rope: RotaryEmbeddingsConfig = dataclasses.field(default_factory=DefaultRotaryEmbeddingsConfig)
    attn_backend: Optional[AttentionBackend] = None
    flash_attention_block_size: Optional[int] = None
    cross_entropy_block_size: Optional[int] = None
    """Vocabulary block of qkvflow's fused training loss (qkvflow.training.loss); None: the whole vocabulary at once.
    (Levanter 1.2's LmConfig had this field; marin-levanter's has not, so DiffEqFormer configs keep it.)"""

    def __post_init__(self):
        for name in ("max_seq_len", "hidden_dim", "num_heads", "num_frequencies"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        _check(self.time_embed_dim >= 1, "time_embed_dim", self.time_embed_dim, "an integer >= 1 (d_emb)")
        _check(
            self.hidden_dim % self.num_heads == 0,
            "num_heads",
            self.num_heads,
            f"a divisor of hidden_dim={self.hidden_dim}",
        )
        if self.intermediate_dim is not None:
            _check(self.intermediate_dim >= 1, "intermediate_dim", self.intermediate_dim, "null or an integer >= 1")
        _check(self.time_scale > 0, "time_scale", self.time_scale, "a positive float")
        _check(self.time_max_period > 1, "time_max_period", self.time_max_period, "a float > 1")
        _check(self.kinetic_weight >= 0, "kinetic_weight", self.kinetic_weight, "a float >= 0")
        _check(self.exits in EXITS, "exits", self.exits, f"one of {list(EXITS)}")
        if self.exits != "none":
            _check(
                not self.ode.is_adaptive,
                "exits",
                self.exits,
                f"'none' with the adaptive solver ode.solver={self.ode.solver!r}: exits sit on a fixed grid of "
                "ode.num_steps steps (a fixed-step solver, or ode.adaptive: false)",
            )
        if self.dial.active:
            _check(
                self.exits == "none" and not self.ode.is_adaptive,
                "dial",
                self.dial,
                f"no recipe with exits={self.exits!r} or the adaptive solver {self.ode.solver!r}: the depth-dial "
                "recipes train a fixed-step solver's loss at t = 1",
            )
            _check(
                not self.dial.random_time or self.ode.solver == "euler",
                "dial.random_time",
                True,
                f"false with ode.solver={self.ode.solver!r}: the random Euler scheme is Euler's",
            )
        self._check_dropout()
        _check(self.matrix_init in ("normal", "fan_in"), "matrix_init", self.matrix_init, "'normal' or 'fan_in'")
        _check(self.initializer_range > 0, "initializer_range", self.initializer_range, "a positive float")
        self._check_variant()

    def _check_dropout(self):
        for name in ("embed_pdrop", "resid_pdrop"):
            p = getattr(self, name)
            _check(0 <= p < 1, name, p, "a probability in [0, 1)")
            if p > 0:
                why = "dropout is applied on the plain training loss"
                _check(not self.dial.active and self.exits == "none", name, p, f"0 with dial recipes or exits ({why})")
        _check(
            self.resid_pdrop == 0 or not self.ode.is_adaptive,
            "resid_pdrop",
            self.resid_pdrop,
            f"0 with the adaptive solver ode.solver={self.ode.solver!r} (fresh masks at every time defeat "
            "step-size control; use a fixed-step solver)",
        )
        _check(
            self.resid_pdrop == 0 or self.ode.adjoint != "backsolve",
            "resid_pdrop",
            self.resid_pdrop,
            "0 with ode.adjoint: backsolve (its backward solve meets other times, so other masks, than the "
            "forward one; use recursive_checkpoint)",
        )

    def _check_variant(self):
        _check(self.variant in ("qkvflow", "official"), "variant", self.variant, "'qkvflow' or 'official'")
        grids = ("left", "right") if self.variant == "official" else ("left",)
        _check(self.time_grid in (None, *grids), "time_grid", self.time_grid, f"null or one of {list(grids)}")
        if self.variant == "official":
            why = "the official code's hypernetworks are implemented for the GPT-2 flavour's DiffEqFormer only"
            _check(self.flavour == "gpt2" and self.generator == "hyper", "variant", self.variant, f"'qkvflow' ({why})")
            for key in ("shared_time_mlp", "time_embed_norm", "exits"):
                _check(getattr(self, key) in (False, "none"), key, getattr(self, key), "off with variant: official")
            _check(
                not (self.ode.is_adaptive and self.resolved_time_grid == "right"),
                "time_grid",
                self.resolved_time_grid,
                "'left' with an adaptive solver (the right grid shifts W by one fixed step, 1/N)",
            )

    @property
    def resolved_time_grid(self) -> str:
        return self.time_grid or ("right" if self.variant == "official" else "left")

    # --- flavour-dependent defaults -------------------------------------------------------------
    @property
    def mlp_dim(self) -> int:
        return self.flavour_spec.mlp_dim(self.hidden_dim, self.intermediate_dim)

    @property
    def bias(self) -> bool:
        return self.flavour_spec.biases if self.use_bias is None else self.use_bias

    @property
    def tied_embeddings(self) -> bool:
        return self.flavour_spec.tied_embeddings if self.tie_word_embeddings is None else self.tie_word_embeddings

    # --- named axes (positions: Levanter's `max_Pos` and `KeyPos`) --------------------------------
    Embed = property(lambda self: Axis("embed", self.hidden_dim))
    Heads = property(lambda self: Axis("heads", self.num_heads))
    HeadSize = property(lambda self: Axis("head_size", self.hidden_dim // self.num_heads))
    Mlp = property(lambda self: Axis("mlp", self.mlp_dim))

    @property
    def model_type(self) -> Type:
        return DiffEqFormerLMHeadModel

    def flops_per_token(self, vocab_size: int, context_length: int) -> Optional[float]:
        return forward_flops_per_token(self, vocab_size, context_length)


@register("diffeqformer_gpt2", flavour=GPT2, ode=True, discretises_to="parallel_gpt2")
@dataclass(frozen=True)
class DiffEqFormerGpt2Config(DiffEqFormerConfig):
    """The DiffEqFormer with GPT-2 blocks (LayerNorm, GELU feed-forward, learned positions)."""


@register("diffeqformer_llama", flavour=LLAMA, ode=True, discretises_to="parallel_llama")
@dataclass(frozen=True)
class DiffEqFormerLlamaConfig(DiffEqFormerConfig):
    """The DiffEqFormer with Llama blocks (RMSNorm, SwiGLU, rotary positions); Llama's eps and gate."""

    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.silu
    layer_norm_epsilon: float = 1e-6


@register("shared_ode_gpt2", flavour=GPT2, ode=True, discretises_to="parallel_gpt2")
@dataclass(frozen=True)
class SharedOdeGpt2Config(DiffEqFormerGpt2Config):
    """Weight-shared baseline (N-ODE Transformer): constant W plus c * t biases, GPT-2 blocks."""

    generator: ClassVar[str] = "shared"


@register("shared_ode_llama", flavour=LLAMA, ode=True, discretises_to="parallel_llama")
@dataclass(frozen=True)
class SharedOdeLlamaConfig(DiffEqFormerLlamaConfig):
    """Weight-shared baseline with Llama blocks."""

    generator: ClassVar[str] = "shared"


GENERATORS = {"hyper": HyperGenerator, "shared": SharedGenerator}


class RawField(eqx.Module):
    """`DiffEqFormerLMHeadModel.raw_field`: a module, not a closure, so that the field's parameters reach
    diffrax's compiled solve as inputs (a closure's would be constants, and a new closure per call, as
    when the model runs outside `jit`, compiled the solve again every call)."""

    field: eqx.Module
    config: "DiffEqFormerConfig" = eqx.field(static=True)
    axes: tuple = eqx.field(static=True)
    dtype: Optional[jnp.dtype] = eqx.field(static=True)

    key: Optional[jax.Array] = None  # residual dropout's key (a training step); masks per t (fields.dropout)

    def __call__(self, t, y, args):
        source, mask, pos = args
        x = hax.named(y.astype(self.dtype or y.dtype), self.axes)
        key = time_key(self.key, t)
        dx = self.field.vector_field(source(t), x, config=self.config, mask=mask, pos_ids=pos, key=key)
        return dx.rearrange(self.axes).array.astype(y.dtype)


class DiffEqFormerLMHeadModel(LmHeadModel[DiffEqFormerConfig]):
    """Levanter's `LmHeadModel` whose depth is an ODE solve (the module docstring's three lines).

    `flow` integrates the flavour's field with the generator's W(t) (`qkvflow.integrate`); `activations`
    is norm(x(1)), so Levanter's trainer, evaluator and loss use the model as they use a GPT-2.
    """

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
        return self._config.flavour_spec.field

    @classmethod
    def init(cls, Vocab: Axis, config: DiffEqFormerConfig, *, key) -> "DiffEqFormerLMHeadModel":
        k_tok, k_pos, k_gen, k_head = jrandom.split(key, 4)
        Embed, std = config.Embed, config.initializer_range
        tokens = hnn.Embedding.init(Vocab, Embed, key=k_tok, initializer_range=std)
        positions = None
        flavour = config.flavour_spec
        if flavour.learned_positions:
            positions = hnn.Embedding.init(config.max_Pos, Embed, key=k_pos, initializer_range=std / 2)
        specs = flavour.field.weight_specs(config)
        official = config.variant == "official"
        generator = (OfficialGenerator if official else GENERATORS[config.generator]).init(specs, config, key=k_gen)
        final_norm = official_final_norm(config) if official else flavour.init_norm(Embed, config.layer_norm_epsilon)
        lm_head = None if config.tied_embeddings else normal(k_head, (Embed, Vocab)) * std
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
        ts=None,
        key=None,
    ) -> tuple[NamedArray, Optional[jnp.ndarray], OdeStats]:
        """x(1) before the final norm, the kinetic energy (None when off) and solver statistics.

        A missing mask means causal: the model is a language model. With `ts` (increasing times in
        (0, 1], the last 1) the states x(t) at those times instead, on a leading `exit` axis
        (`qkvflow.models.related.ode_exits`). The solver holds the state in float32 (see `raw_field`);
        what it returns is in the embedding's dtype, as a discrete transformer's residual stream is.
        A `key` (a training step) turns on `embed_pdrop` and `resid_pdrop` (qkvflow.models.fields.dropout).
        """
        config = self._config
        if attn_mask is None:
            attn_mask = AttentionMask.causal()
        if pos_ids is None:
            pos_ids = hax.arange(input_ids.resolve_axis(self.Pos.name), dtype=jnp.int32)
        k_embed, k_field = (None, None) if key is None else jrandom.split(key)
        x0 = dropout(self.embed(input_ids, pos_ids), config.embed_pdrop, k_embed)
        field = self.raw_field(x0.axes, x0.dtype, key=k_field if config.resid_pdrop > 0 else None)
        axes = x0.axes
        source = WeightSource.build(self.generator, config.ode)
        tokens = x0.size // config.hidden_dim if config.kinetic_weight > 0 else None
        args = (source, attn_mask, pos_ids)
        if ts is None:
            y1, energy, stats = integrate(field, x0.array, args, config.ode, tokens=tokens)
            return hax.named(y1.astype(x0.dtype), axes), energy, stats
        ys, energy, stats = integrate(field, x0.array, args, config.ode, tokens=tokens, ts=ts)
        return hax.named(ys.astype(x0.dtype), (Axis("exit", ys.shape[0]), *axes)), energy, stats

    def raw_field(self, axes, dtype=None, key=None) -> "RawField":
        """The vector field on raw arrays laid out as `axes`, as diffrax calls it:
        `f(t, y, (weight_source, mask, pos_ids)) -> dy/dt`, computed in `dtype` (None: y's).

        Pass the embedding's dtype: diffrax holds the state in the promotion of y0's and the time's
        dtypes (`diffeqsolve` casts y0 to it), so under a bfloat16 compute policy y arrives in float32.
        The field casts it down on entry, so that its products run in the compute dtype, as a
        discrete transformer's layers do, while the solver accumulates the state in float32.
        `key`: residual dropout's (a training step; None evaluates without dropout)."""
        return RawField(self.field, self._config, tuple(axes), dtype, key)

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        key=None,
        pos_ids: Optional[NamedArray] = None,
    ):
        x, _, _ = self.flow(input_ids, attn_mask, pos_ids=pos_ids, key=key)
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
