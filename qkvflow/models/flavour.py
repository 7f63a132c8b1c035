"""What differs between the GPT-2 and Llama flavours of every qkvflow model, as data.

A flavour is the block design shared by a family's ODE field (`qkvflow.models.fields`), its discrete
parallel blocks (`qkvflow.models.discrete`) and the torch twin (`qkvflow.export.hf`):

| flavour | norm                | feed-forward                     | positions              | biases, tied head |
|---------|---------------------|----------------------------------|------------------------|-------------------|
| gpt2    | LayerNorm (+ bias)  | act(m W_up) W_down               | learned, absolute      | yes, yes          |
| llama   | RMSNorm (float32)   | (silu(m W_gate) * m W_up) W_down | rotary (half-split)    | no, no            |

Code asks a flavour what it needs (`flavour.rotary`, `flavour.gated_mlp`, `flavour.norm(...)`) instead of
comparing its name, so a new flavour is one `Flavour(...)` value, not a dozen `if name == ...` branches.
The name stays the flavour's identifier in configs (`config.flavour`) and exported model types.
"""

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp

from qkvflow.models.fields import gpt2 as gpt2_field
from qkvflow.models.fields import llama as llama_field


def four_times(hidden_dim: int) -> int:
    """GPT-2's feed-forward width, 4 h (Radford et al. 2019)."""
    return 4 * hidden_dim


def swiglu_width(hidden_dim: int) -> int:
    """SwiGLU's width 8h/3 (same parameters as a 4h two-matrix MLP), rounded up to a multiple of 64
    (Touvron et al. 2023, "LLaMA", section 2.2)."""
    return -(-(8 * hidden_dim // 3) // 64) * 64


@dataclass(frozen=True)
class Flavour:
    """One block design. Every field is read by some model, export or accounting code; see the module table."""

    name: str
    """Identifier: `config.flavour`, and the suffix of the exported `qkvflow_parallel_{name}` model type."""
    field: ModuleType
    """The ODE vector field: a module with `weight_specs(config)`, `vector_field(...)` and `_norm(...)`."""
    layer_norm: bool
    """LayerNorm with a bias (True) or float32 RMSNorm without one (False), for every norm of the model."""
    gated_mlp: bool
    """SwiGLU feed-forward (gate_proj, up_proj, down_proj; silu gate) instead of act(up_proj) down_proj."""
    learned_positions: bool
    """A learned absolute position embedding is added to the token embedding."""
    rotary: bool
    """Attention rotates q and k by `config.rope` (Levanter's half-split rotary embeddings)."""
    biases: bool
    """Default of `use_bias` (ODE) and `attention_bias` / `mlp_bias` (discrete) when the config says None."""
    tied_embeddings: bool
    """Default of `tie_word_embeddings` when the config says None."""
    mlp_width: Callable[[int], int]
    """Default feed-forward width from hidden_dim, when `intermediate_dim` is None."""
    ffn_modules: tuple[tuple[str, str], ...]
    """(field weight, `ParallelBlock.mlp` module) pairs (biases follow as f"{name}_bias"); the discretisation's map."""
    hf_name: str
    """Class-name infix of the torch twin: `QkvflowParallel{hf_name}Config` / `...ForCausalLM`."""
    baseline: str
    """Levanter's discrete model of the same design (`LmConfig` type name), the speed benchmark's baseline."""

    @property
    def hf_model_type(self) -> str:
        return f"qkvflow_parallel_{self.name}"

    def mlp_dim(self, hidden_dim: int, intermediate_dim: Optional[int]) -> int:
        return self.mlp_width(hidden_dim) if intermediate_dim is None else intermediate_dim

    def hidden_act(self, activation) -> str:
        """transformers' `hidden_act`: the gated flavour's gate is always silu, whatever `activation` says."""
        return "silu" if self.gated_mlp else activation.value

    def init_norm(self, Embed, eps: float) -> hnn.LayerNorm | hnn.RmsNorm:
        """A fresh norm as Haliax initialises it (the ODE model's final norm)."""
        if self.layer_norm:
            return hnn.LayerNorm.init(Embed, eps=eps, use_bias=True)
        return hnn.RmsNorm.init(Embed, eps=eps, use_bias=False)

    def norm(self, Embed, eps: float, weight=None, bias=None) -> hnn.LayerNorm | hnn.RmsNorm:
        """A norm holding `weight` (and `bias`), ones and zeros when None: the discrete blocks' pre-norms."""
        weight = hax.ones(Embed) if weight is None else weight
        if self.layer_norm:
            bias = hax.zeros(Embed) if bias is None else bias
            return hnn.LayerNorm(Embed, weight, bias, eps=eps)
        return hnn.RmsNorm(Embed, weight, None, eps=eps, dtype=jnp.float32)

    def replace(self, **changes) -> "Flavour":
        """A variant of this flavour (e.g. a new family that differs in one respect)."""
        return dataclasses.replace(self, **changes)


GPT2 = Flavour(
    name="gpt2",
    field=gpt2_field,
    layer_norm=True,
    gated_mlp=False,
    learned_positions=True,
    rotary=False,
    biases=True,
    tied_embeddings=True,
    mlp_width=four_times,
    ffn_modules=(("w1", "up_proj"), ("w2", "down_proj")),
    hf_name="Gpt2",
    baseline="gpt2",
)
LLAMA = Flavour(
    name="llama",
    field=llama_field,
    layer_norm=False,
    gated_mlp=True,
    learned_positions=False,
    rotary=True,
    biases=False,
    tied_embeddings=False,
    mlp_width=swiglu_width,
    ffn_modules=(("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")),
    hf_name="Llama",
    baseline="llama",
)
