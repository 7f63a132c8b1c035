"""Turn a DiffEqFormer into a discrete parallel-block transformer: its explicit Euler solve as layers.

With M steps, dt = 1/M and t_k = k/M, Euler computes

    x_{k+1} = x_k + dt F(W(t_k), x_k)
            = x_k + (dt O_k) Attn(norm_a(x_k)) + dt o_bias_k + (dt W2_k) ffn(norm_m(x_k)) + dt b2_k,

so block k of a `ParallelLMHeadModel` holds W(t_k) with dt folded into the output projections
(o, o_bias, and w2, w2_bias / w_down, w_down_bias); all other weights are W(t_k) unchanged. With
M = ode.num_steps and an Euler ODE config, the discrete model computes the same logits as the ODE
model. Only Euler maps onto single blocks: a multi-stage method's step x_k + dt sum_j b_j F(W, y_j)
evaluates F at intermediate states y_j, which is not one residual block per evaluation.

Both generators work: a `SharedGenerator` (shared_ode_*) gives constant matrices plus the biases
c * t_k, which become ordinary biases of every projection.
"""

import haliax.nn as hnn
import jax.numpy as jnp
import numpy as np
from haliax.nn.scan import ScanCheckpointPolicy, Stacked

from qkvflow.errors import UserError
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.weight_source import evaluation_times, generate_batched, weight_times
from qkvflow.models import registry
from qkvflow.models.diffeqformer import DiffEqFormerConfig, DiffEqFormerLMHeadModel
from qkvflow.models.discrete.layers import ParallelAttention, ParallelBlock, make_mlp, make_norm
from qkvflow.models.discrete.model import ParallelConfig, ParallelLMHeadModel, ParallelTransformer

SOLVERS = ("euler",)

# Field weight -> module of ParallelBlock (biases follow as f"{name}_bias"); also in docs/export.md:
# attn_norm, mlp_norm -> themselves; q, k, v, o -> self_attn.{q,k,v,o}_proj; the feed-forward's weights
# -> mlp.* as the flavour's `ffn_modules` says (w1, w2 -> up_proj, down_proj for GPT-2).
FOLDED = ("o", "w2", "w_down")
"""Output projections of the two branches: they (and their biases) carry the factor dt."""


def step_times(steps: int) -> np.ndarray:
    """t_k = k / M, k = 0..M-1: the times an M-step Euler solve evaluates W (as the ODE solve does)."""
    return evaluation_times(OdeConfig(num_steps=steps, solver="euler"))


def discrete_config(config: DiffEqFormerConfig, steps: int, weights: dict) -> ParallelConfig:
    """The parallel config with M = `steps` layers that holds `weights` (the generator's W(t_k)), of the
    family that `config`'s family declares it discretises to."""
    first_ffn_weight = config.flavour_spec.ffn_modules[0][0]
    return registry.discrete_family(config).config_class(
        max_seq_len=config.max_seq_len,
        hidden_dim=config.hidden_dim,
        num_heads=config.num_heads,
        num_layers=steps,
        intermediate_dim=config.mlp_dim,
        initializer_range=config.initializer_range,
        layer_norm_epsilon=config.layer_norm_epsilon,
        activation_function=config.activation_function,
        attention_bias="q_bias" in weights,
        mlp_bias=f"{first_ffn_weight}_bias" in weights,
        tie_word_embeddings=config.tied_embeddings,
        rope=config.rope,
        attn_backend=config.attn_backend,
        flash_attention_block_size=config.flash_attention_block_size,
    )


def _linear(weights: dict, name: str, In, Out, scale: float) -> hnn.Linear:
    """Linear over a leading `layers` axis, weight laid out (layers, *Out, *In) as torch stores it."""
    w = weights[name] * scale if name in FOLDED else weights[name]
    w = w.rearrange(("layers", *(a.name for a in Out), *(a.name for a in In)))
    b = weights.get(f"{name}_bias")
    if b is not None and name in FOLDED:
        b = b * scale
    return hnn.Linear(w, b, In if len(In) > 1 else In[0], Out if len(Out) > 1 else Out[0])


def _blocks(config: ParallelConfig, w: dict, dt: float) -> ParallelBlock:
    Embed, Qkv, Mlp = (config.Embed,), (config.Heads, config.HeadSize), (config.Mlp,)
    attn = ParallelAttention(
        config,
        _linear(w, "q", Embed, Qkv, dt),
        _linear(w, "k", Embed, Qkv, dt),
        _linear(w, "v", Embed, Qkv, dt),
        _linear(w, "o", Qkv, Embed, dt),
    )
    projections = {}
    for name, module in config.flavour_spec.ffn_modules:  # down_proj reads the Mlp axis, the others write it
        In, Out = (Mlp, Embed) if module == "down_proj" else (Embed, Mlp)
        projections[module] = _linear(w, name, In, Out, dt)
    norms = [make_norm(config, w[n], w.get(f"{n}_bias")) for n in ("attn_norm", "mlp_norm")]
    return ParallelBlock(norms[0], attn, norms[1], make_mlp(config, projections))


def discretise(model, steps: int, solver: str = "euler") -> ParallelLMHeadModel:
    """The M = `steps`-layer parallel transformer that computes `model`'s M-step Euler solve."""
    if not isinstance(model, DiffEqFormerLMHeadModel):
        raise UserError(f"discretise needs a DiffEqFormerLMHeadModel; got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise UserError(f"steps={steps!r} is invalid: expected an integer >= 1 (the number of layers)")
    if solver not in SOLVERS:
        raise UserError(
            f"solver={solver!r} is invalid: expected one of {list(SOLVERS)} (only an Euler step is one residual block)"
        )
    euler = OdeConfig(num_steps=steps, solver="euler")
    weights = generate_batched(model.generator, jnp.asarray(weight_times(model.generator, euler)))
    weights = {name: w.rename({"ode_time": "layers"}) for name, w in weights.items()}
    config = discrete_config(model.config, steps, weights)
    policy = ScanCheckpointPolicy.from_bool_or_str(config.gradient_checkpointing)
    layers = Stacked(_blocks(config, weights, 1.0 / steps), config.Layers, policy)
    final_norm = model.final_norm
    if isinstance(final_norm, hnn.LayerNorm) and final_norm.bias is None:  # official, use_bias: false
        final_norm = make_norm(config, final_norm.weight)  # a zero shift, so exports keep GPT-2's layout
    transformer = ParallelTransformer(config, model.token_embeddings, model.position_embeddings, layers, final_norm)
    lm_head = None
    if model.lm_head is not None:
        lm_head = hnn.Linear(model.lm_head.rearrange((model.Vocab, config.Embed)), None, config.Embed, model.Vocab)
    return ParallelLMHeadModel(transformer, lm_head)
