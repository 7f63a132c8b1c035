"""The DiffEqFormer's logits against a reference written here, in float64 numpy, from the equations.

Nothing of the model's own field code is used: only its parameters (embeddings, final norm, head)
and its generator's weights W(t_k), whose formula tests/nn/test_time_dependent.py checks. So a change
of activation, norm, epsilon, attention scaling or rotary convention in the fields fails here, unlike
in tests that build the reference from `model.field.vector_field`.

    GPT-2:  dx/dt = O Attn(LN_a(x)) + o_b + W2 gelu_tanh(W1 LN_m(x) + b1) + b2
    Llama:  dx/dt = O Attn_rope(RMS_a(x)) + W_down (silu(W_gate m) * W_up m),   m = RMS_m(x)
    Euler:  x_{k+1} = x_k + dx/dt(t_k, x_k) / N,   t_k = k / N
"""

import math

import numpy as np
import pytest
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.integrate.config import OdeConfig
from tests.helpers import random_tokens, tiny_config, tiny_model

N = 4


def _np(named, *axes):
    return np.asarray(named.rearrange(axes).array, dtype=np.float64)


def layer_norm(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def rms_norm(x, scale, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x / (1 + np.exp(-x))


def rope(x, theta=10000.0):
    """Rotary embedding, rotate-half convention (x: position, heads, head_size)."""
    pos, d = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angle = np.arange(pos)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angle, angle], -1)), np.sin(np.concatenate([angle, angle], -1))
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None, :] + half * sin[:, None, :]


def attention(h, w, heads, rotary, bias):
    """Causal multi-head attention of h (position, embed) with weights q, k, v (embed, heads, head_size)."""

    def proj(name):
        y = np.einsum("pe,ehd->phd", h, w[name])
        return y + w[f"{name}_bias"] if bias else y

    q, k, v = proj("q"), proj("k"), proj("v")
    if rotary:
        q, k = rope(q), rope(k)
    scores = np.einsum("phd,shd->hps", q, k) / math.sqrt(q.shape[-1])
    causal = np.tril(np.ones((h.shape[0], h.shape[0]), bool))
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hps,shd->phd", p, v)
    o = np.einsum("phd,hde->pe", out, w["o"])
    return o + w["o_bias"] if bias else o


def gpt2_field(w, x, eps, heads):
    attn = attention(layer_norm(x, w["attn_norm"], w["attn_norm_bias"], eps), w, heads, rotary=False, bias=True)
    m = layer_norm(x, w["mlp_norm"], w["mlp_norm_bias"], eps)
    return attn + gelu_tanh(m @ w["w1"] + w["w1_bias"]) @ w["w2"] + w["w2_bias"]


def llama_field(w, x, eps, heads):
    attn = attention(rms_norm(x, w["attn_norm"], eps), w, heads, rotary=True, bias=False)
    m = rms_norm(x, w["mlp_norm"], eps)
    return attn + (silu(m @ w["w_gate"]) * (m @ w["w_up"])) @ w["w_down"]


def generated_weights(model, t):
    """W(t) as plain arrays laid out (in, out): matrices (embed, heads, head_size), (heads, head_size, embed), ..."""
    layouts = {
        "q": ("embed", "heads", "head_size"),
        "k": ("embed", "heads", "head_size"),
        "v": ("embed", "heads", "head_size"),
        "o": ("heads", "head_size", "embed"),
        "w1": ("embed", "mlp"),
        "w2": ("mlp", "embed"),
        "w_gate": ("embed", "mlp"),
        "w_up": ("embed", "mlp"),
        "w_down": ("mlp", "embed"),
    }
    out = {}
    for name, w in model.generator(t).items():
        axes = layouts.get(name) or tuple(a.name for a in w.axes)
        out[name] = _np(w, *axes)
    return out


def reference_logits(model, ids, steps=N):
    config = model.config
    tokens = np.asarray(ids.array)
    x = _np(model.token_embeddings.weight, "vocab", "embed")[tokens]
    if config.flavour == "gpt2":
        x = x + _np(model.position_embeddings.weight, "position", "embed")[: len(tokens)]
    field = gpt2_field if config.flavour == "gpt2" else llama_field
    for k in range(steps):
        x = x + field(generated_weights(model, k / steps), x, config.layer_norm_epsilon, config.num_heads) / steps
    norm = model.final_norm
    if config.flavour == "gpt2":
        x = layer_norm(x, _np(norm.weight, "embed"), _np(norm.bias, "embed"), config.layer_norm_epsilon)
    else:
        x = rms_norm(x, _np(norm.weight, "embed"), config.layer_norm_epsilon)
    return x @ _np(model.get_lm_head(), "embed", "vocab")


def test_flavour_defaults_are_pinned():
    """The defaults the reference below assumes (GPT-2: tanh GELU, LayerNorm eps 1e-5, biases, tied head;
    Llama: SwiGLU, RMSNorm eps 1e-6, no biases, untied head, rotary theta 1e4)."""
    gpt2, llama = tiny_config("gpt2"), tiny_config("llama")
    assert gpt2.activation_function == ActivationFunctionEnum.gelu_new and gpt2.layer_norm_epsilon == 1e-5
    assert gpt2.bias and gpt2.tied_embeddings and gpt2.mlp_dim == 4 * gpt2.hidden_dim
    assert llama.layer_norm_epsilon == 1e-6 and not llama.bias and not llama.tied_embeddings
    assert llama.rope.theta == 10000 and getattr(llama.rope, "factor", 1.0) == 1.0
    assert gpt2.ode.solver == "euler" and llama.ode.solver == "euler"


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_logits_equal_the_equations(flavour):
    # initializer_range 0.2 makes every term matter: a field with ReLU for GELU, or without an epsilon,
    # or with another rotary convention moves the logits by far more than the tolerance.
    config = tiny_config(flavour, ode=OdeConfig(num_steps=N), initializer_range=0.2, max_seq_len=12)
    model = tiny_model(config)
    ids = random_tokens(config)["batch", 0]
    ours = np.asarray(model(ids).rearrange(("position", "vocab")).array, dtype=np.float64)
    ref = reference_logits(model, ids)
    # float32 round-off: measured at about 4 ulps of the logits' scale after N = 4 steps (both flavours);
    # it grows with the number of steps, so allow 4 ulps per step.
    scale = np.max(np.abs(ref))
    tol = 4 * N * np.finfo(np.float32).eps * scale
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
    # the flow matters: a solve that did nothing (the logits of x(0)) would be far off
    assert np.max(np.abs(ref - reference_logits(model, ids, steps=0))) > 100 * tol
