"""The baseline of `qkvflow bench speed`: Levanter's discrete model of the DiffEqFormer's shape.

Same hidden size, heads, MLP, sequence and vocabulary, with one layer per vector-field evaluation of the
ODE's solve (`accounting.nominal_evaluations`), so that both models do the same work per token; the
flavour names which of Levanter's models it is (`flavour.baseline`: gpt2 or llama). `remat` is Levanter's
`gradient_checkpointing` (its default: on).
"""

from qkvflow.errors import UserError
from qkvflow.models.accounting import nominal_evaluations


def baseline_config(model, *, remat: bool = True):
    """Levanter's discrete model of the same shape, with one layer per vector-field evaluation
    (the flavour's `baseline`: Levanter's gpt2 or llama)."""
    return BASELINES[model.flavour_spec.baseline](model, nominal_evaluations(model), remat)


def _gpt2_baseline(model, layers: int, remat: bool):
    from levanter.models.gpt2 import Gpt2Config

    if model.mlp_dim % model.hidden_dim:
        raise UserError(f"intermediate_dim={model.mlp_dim} must be a multiple of hidden_dim for the GPT-2 baseline")
    return Gpt2Config(
        max_seq_len=model.max_seq_len,
        hidden_dim=model.hidden_dim,
        num_layers=layers,
        num_heads=model.num_heads,
        mlp_scale=model.mlp_dim // model.hidden_dim,
        initializer_range=model.initializer_range,
        layer_norm_epsilon=model.layer_norm_epsilon,
        activation_function=model.activation_function,
        use_bias=model.bias,
        gradient_checkpointing=remat,
    )


def _llama_baseline(model, layers: int, remat: bool):
    from levanter.models.llama import LlamaConfig

    return LlamaConfig(
        max_seq_len=model.max_seq_len,
        hidden_dim=model.hidden_dim,
        intermediate_dim=model.mlp_dim,
        num_layers=layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_heads,
        activation_function=model.activation_function,
        initializer_range=model.initializer_range,
        layer_norm_epsilon=model.layer_norm_epsilon,
        tie_word_embeddings=model.tied_embeddings,
        rope=model.rope,
        gradient_checkpointing=remat,
    )


BASELINES = {"gpt2": _gpt2_baseline, "llama": _llama_baseline}
"""Levanter type name -> builder of that baseline (flavour.baseline names one)."""
