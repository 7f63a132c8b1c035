"""Hugging Face configs of the discretised DiffEqFormer (parallel-block transformer).

Self-contained (transformers only): `qkvflow export` copies this file into every exported folder,
where `AutoConfig.from_pretrained(DIR, trust_remote_code=True)` loads it through `auto_map`.

    model_type               norm       feed-forward        positions
    qkvflow_parallel_gpt2    LayerNorm  act(x U) D          learned absolute (max_position_embeddings)
    qkvflow_parallel_llama   RMSNorm    silu(x G) * (x U) D rotary, half-split, theta = rope_theta
"""

from transformers import PretrainedConfig


class QkvflowParallelConfig(PretrainedConfig):
    """The fields of a parallel-block model. The flavour's design is class data, mirroring
    qkvflow.models.flavour (this file must not import qkvflow): `layer_norm` (LayerNorm, else RMSNorm),
    `gated_mlp` (SwiGLU), `learned_positions` (else rotary)."""

    model_type = "qkvflow_parallel"
    flavour = "gpt2"
    layer_norm = True
    gated_mlp = False
    learned_positions = True
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50257,
        hidden_size: int = 768,
        num_attention_heads: int = 12,
        num_hidden_layers: int = 12,
        intermediate_size: int = 3072,
        max_position_embeddings: int = 1024,
        layer_norm_eps: float = 1e-5,
        hidden_act: str = "gelu_new",
        attention_bias: bool = True,
        mlp_bias: bool = True,
        rope_theta: float = 10000.0,
        rope_scaling_factor: float = 1.0,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        ode_steps: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.hidden_act = hidden_act
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.rope_theta = rope_theta
        self.rope_scaling_factor = rope_scaling_factor
        self.initializer_range = initializer_range
        self.ode_steps = ode_steps  # N of the ODE model this was discretised from (information only)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class QkvflowParallelGpt2Config(QkvflowParallelConfig):
    model_type = "qkvflow_parallel_gpt2"
    flavour = "gpt2"
    layer_norm, gated_mlp, learned_positions = True, False, True


class QkvflowParallelLlamaConfig(QkvflowParallelConfig):
    model_type = "qkvflow_parallel_llama"
    flavour = "llama"
    layer_norm, gated_mlp, learned_positions = False, True, False

    def __init__(self, hidden_act="silu", layer_norm_eps=1e-6, attention_bias=False, mlp_bias=False, **kwargs):
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.update(hidden_act=hidden_act, layer_norm_eps=layer_norm_eps)
        super().__init__(attention_bias=attention_bias, mlp_bias=mlp_bias, **kwargs)
