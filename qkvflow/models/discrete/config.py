"""Configs of the discrete parallel-block transformer, registered with Levanter as model types.

| type            | norm      | feed-forward          | positions           |
|-----------------|-----------|-----------------------|---------------------|
| parallel_gpt2   | LayerNorm | act(x W_up) W_down    | learned, absolute   |
| parallel_llama  | RMSNorm   | SwiGLU (gate, up)     | rotary (half-split) |

Each of the `num_layers` blocks is one Euler step of a DiffEqFormer's field (see
`qkvflow.models.discrete.model`); `qkvflow.export.discretise` builds one from an ODE checkpoint, and
Levanter's trainer can also train one from scratch (`model: {type: parallel_gpt2, ...}`).
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


@dataclass(frozen=True)
class ParallelConfig(LmConfig):
    flavour: ClassVar[str] = "gpt2"

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

    def __post_init__(self):
        for name in ("max_seq_len", "hidden_dim", "num_heads", "num_layers"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        divides = self.hidden_dim % self.num_heads == 0
        _check(divides, "num_heads", self.num_heads, f"a divisor of hidden_dim={self.hidden_dim}")
        if self.intermediate_dim is not None:
            _check(self.intermediate_dim >= 1, "intermediate_dim", self.intermediate_dim, "null or an integer >= 1")

    # --- flavour-dependent defaults (the same rules as DiffEqFormerConfig) -----------------------
    @property
    def mlp_dim(self) -> int:
        if self.intermediate_dim is not None:
            return self.intermediate_dim
        if self.flavour == "gpt2":
            return 4 * self.hidden_dim
        return -(-(8 * self.hidden_dim // 3) // 64) * 64

    def _flavour_default(self, value: Optional[bool]) -> bool:
        return self.flavour == "gpt2" if value is None else value

    has_attention_bias = property(lambda self: self._flavour_default(self.attention_bias))
    has_mlp_bias = property(lambda self: self._flavour_default(self.mlp_bias))
    tied_embeddings = property(lambda self: self._flavour_default(self.tie_word_embeddings))

    # --- named axes: the same names as the ODE models', so weights move between them by name ------
    # (positions: Levanter's `max_Pos` and `KeyPos`)
    Embed = property(lambda self: Axis("embed", self.hidden_dim))
    Heads = property(lambda self: Axis("heads", self.num_heads))
    HeadSize = property(lambda self: Axis("head_size", self.hidden_dim // self.num_heads))
    Mlp = property(lambda self: Axis("mlp", self.mlp_dim))
    Layers = property(lambda self: Axis("layers", self.num_layers))

    @property
    def model_type(self) -> Type:
        from qkvflow.models.discrete.model import ParallelLMHeadModel

        return ParallelLMHeadModel

    def flops_per_token(self, vocab_size: int, context_length: int) -> Optional[float]:
        from levanter.utils.flop_utils import lm_flops_per_token

        return lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.mlp_dim,
            num_layers=self.num_layers,
            num_kv_heads=self.num_heads,
            num_heads=self.num_heads,
            seq_len=context_length,
            vocab_size=vocab_size,
            glu=self.flavour == "llama",
        )


@LmConfig.register_subclass("parallel_gpt2")
@dataclass(frozen=True)
class ParallelGpt2Config(ParallelConfig):
    flavour: ClassVar[str] = "gpt2"


@LmConfig.register_subclass("parallel_llama")
@dataclass(frozen=True)
class ParallelLlamaConfig(ParallelConfig):
    flavour: ClassVar[str] = "llama"
    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.silu
    layer_norm_epsilon: float = 1e-6


PARALLEL_CONFIGS = {"gpt2": ParallelGpt2Config, "llama": ParallelLlamaConfig}
