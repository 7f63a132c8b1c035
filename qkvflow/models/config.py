"""Model configs, registered with Levanter so that YAML `model: {type: ...}` selects them.

| type                 | field | weights                                   |
|----------------------|-------|-------------------------------------------|
| diffeqformer_gpt2    | gpt2  | hypernetwork W(t) (DiffEqFormer)          |
| diffeqformer_llama   | llama | hypernetwork W(t)                         |
| shared_ode_gpt2      | gpt2  | constant W, plus c*t bias (N-ODE Transf.) |
| shared_ode_llama     | llama | constant W, plus c*t bias                 |

Levanter's own `gpt2` and `llama` configs are the discrete baselines.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional, Type

from haliax import Axis
from levanter.layers.attention import AttentionBackend
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig, RotaryEmbeddingsConfig
from levanter.models.lm_model import LmConfig
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.errors import check as _check
from qkvflow.integrate.config import OdeConfig


@dataclass(frozen=True)
class DiffEqFormerConfig(LmConfig):
    flavour: ClassVar[str] = "gpt2"
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
    """t is multiplied by this before the sinusoids (see qkvflow.nn.time_embedding)."""
    shared_time_mlp: bool = False
    """One time MLP shared by all weights (the paper's ablation) instead of one per weight."""
    time_embed_norm: bool = False
    """Divide silu(MLP(s(t))) by its RMS before Proj, so Proj's share of an Adam step on W(t) is about
    0.8 lr instead of about 0.15 lr (qkvflow.nn.time_dependent; benchmarks/README.md, "Quality")."""

    ode: OdeConfig = dataclasses.field(default_factory=OdeConfig)
    kinetic_weight: float = 0.0
    """lambda of the kinetic regulariser lambda/2 * int mean_tokens ||dx/dt||^2 dt; 0 turns it off."""

    initializer_range: float = 0.02
    matrix_init: str = "normal"
    """"normal": generated matrices start with std initializer_range; "fan_in": 1/sqrt(fan_in), as
    the Linear layers of Levanter's GPT-2 and Llama baselines."""
    layer_norm_epsilon: float = 1e-5
    use_bias: Optional[bool] = None
    """None: True for GPT-2, False for Llama."""
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
        _check(self.kinetic_weight >= 0, "kinetic_weight", self.kinetic_weight, "a float >= 0")
        _check(self.matrix_init in ("normal", "fan_in"), "matrix_init", self.matrix_init, "'normal' or 'fan_in'")
        _check(self.initializer_range > 0, "initializer_range", self.initializer_range, "a positive float")

    # --- flavour-dependent defaults -------------------------------------------------------------
    @property
    def mlp_dim(self) -> int:
        if self.intermediate_dim is not None:
            return self.intermediate_dim
        if self.flavour == "gpt2":
            return 4 * self.hidden_dim
        return -(-(8 * self.hidden_dim // 3) // 64) * 64

    @property
    def bias(self) -> bool:
        return self.flavour == "gpt2" if self.use_bias is None else self.use_bias

    @property
    def tied_embeddings(self) -> bool:
        return self.flavour == "gpt2" if self.tie_word_embeddings is None else self.tie_word_embeddings

    # --- named axes (positions: Levanter's `max_Pos` and `KeyPos`) --------------------------------
    Embed = property(lambda self: Axis("embed", self.hidden_dim))
    Heads = property(lambda self: Axis("heads", self.num_heads))
    HeadSize = property(lambda self: Axis("head_size", self.hidden_dim // self.num_heads))
    Mlp = property(lambda self: Axis("mlp", self.mlp_dim))

    @property
    def model_type(self) -> Type:
        from qkvflow.models.lm import DiffEqFormerLMHeadModel

        return DiffEqFormerLMHeadModel

    def flops_per_token(self, vocab_size: int, context_length: int) -> Optional[float]:
        from qkvflow.models.accounting import forward_flops_per_token

        return forward_flops_per_token(self, vocab_size, context_length)


@LmConfig.register_subclass("diffeqformer_gpt2")
@dataclass(frozen=True)
class DiffEqFormerGpt2Config(DiffEqFormerConfig):
    flavour: ClassVar[str] = "gpt2"


@LmConfig.register_subclass("diffeqformer_llama")
@dataclass(frozen=True)
class DiffEqFormerLlamaConfig(DiffEqFormerConfig):
    flavour: ClassVar[str] = "llama"
    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.silu
    layer_norm_epsilon: float = 1e-6


@LmConfig.register_subclass("shared_ode_gpt2")
@dataclass(frozen=True)
class SharedOdeGpt2Config(DiffEqFormerGpt2Config):
    generator: ClassVar[str] = "shared"


@LmConfig.register_subclass("shared_ode_llama")
@dataclass(frozen=True)
class SharedOdeLlamaConfig(DiffEqFormerLlamaConfig):
    generator: ClassVar[str] = "shared"
