"""`variant: official` against a float64 numpy reference written from the official code's equations.

Source: SDML-KU/qkvflow (commit a3f1547), qkvflow/nn/dynamic.py and time_embed.py. Nothing of qkvflow's
generator or field is used for the reference, only the parameters, read by name:

    s(t)   = [t, sin(1000 t w), cos(1000 t w)],  w_i = exp(-ln(P) i / F), P = 1e4     (SinusoidalPosEmb)
    e_m(t) = L2_m(silu(L1_m(s(t))))          one MLP per module m, no activation after L2
    linear module m:  W_m(t) = e_m P_m + P0_m,   b_m(t) = e_m B_m          (TemporalLinear; c_attn = q,k,v)
    norm module m:    LN(x) * (e_m S_m + 1) + e_m H_m                       (TemporalLayerNorm)
    block:  F(t, x) = c_proj(Attn(c_attn(LN_a(x)))) + c_proj'(gelu_tanh(c_fc(LN_m(x))))
    Euler:  x_{k+1} = x_k + F(t_k, x_k) / N,  t_k = (k + 1) / N (the official loop) or k / N
    logits = LN_f(x_N) E^T (tied), x_0 = E[ids] + P[positions]

With use_bias: false the official code has no b_m, no norm shift H_m and no bias in LN_f (P0_m stays).
"""

import math

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.discretise import discretise
from tests.helpers import random_tokens, tiny_config, tiny_model
from tests.models.test_field_reference import gelu_tanh, layer_norm, silu


def _np(named, *axes):
    return np.asarray(named.rearrange(axes).array, dtype=np.float64)


def _mlp(module, s):
    lin1, lin2 = module.mlp.lin1, module.mlp.lin2
    h = s @ _np(lin1.weight, "time_feature", "time_hidden") + _np(lin1.bias, "time_hidden")
    return silu(h) @ _np(lin2.weight, "time_hidden", "time_embed") + _np(lin2.bias, "time_embed")


def sinusoids(t, num_frequencies, max_period=1e4):
    w = np.exp(-math.log(max_period) * np.arange(num_frequencies) / num_frequencies)
    return np.concatenate([[t], np.sin(1000 * t * w), np.cos(1000 * t * w)])


def official_weights(gen, t, num_frequencies, max_period=1e4):
    """The official modules' weights at t, from their parameters (laid out in, out); biases only where
    the module has their map."""
    s = sinusoids(t, num_frequencies, max_period)
    m = gen.modules
    out = {}
    e = _mlp(m["q_k_v"], s)
    lin = m["q_k_v"].weight
    wqkv = np.einsum("d,dejhc->ejhc", e, _np(lin.weight, "time_embed", "embed", "qkv", "heads", "head_size"))
    wqkv = wqkv + _np(lin.bias, "embed", "qkv", "heads", "head_size")
    for j, name in enumerate("qkv"):
        out[name] = wqkv[:, j]
        if m["q_k_v"].bias is not None:
            b = _np(m["q_k_v"].bias, "time_embed", "qkv", "heads", "head_size")
            out[f"{name}_bias"] = np.einsum("d,djhc->jhc", e, b)[j]
    for name, axes in {"o": ("heads", "head_size", "embed"), "w1": ("embed", "mlp"), "w2": ("mlp", "embed")}.items():
        e = _mlp(m[name], s)
        lin = m[name].weight
        out[name] = np.tensordot(e, _np(lin.weight, "time_embed", *axes), 1) + _np(lin.bias, *axes)
        if m[name].bias is not None:
            out[f"{name}_bias"] = e @ _np(m[name].bias, "time_embed", axes[-1])
    for name in ("attn_norm", "mlp_norm"):
        e = _mlp(m[name], s)
        out[name] = e @ _np(m[name].weight, "time_embed", "embed") + 1.0
        if m[name].bias is not None:
            out[f"{name}_bias"] = e @ _np(m[name].bias, "time_embed", "embed")
    return out


def official_branches(x, w, eps):
    """The block's two branches at one time, attention A(x) and feed-forward M(x), from the weights w."""
    causal = np.tril(np.ones((len(x), len(x)), bool))
    h = layer_norm(x, w["attn_norm"], w.get("attn_norm_bias", 0.0), eps)
    q, kk, v = (np.einsum("pe,ehd->phd", h, w[a]) + w.get(f"{a}_bias", 0.0) for a in "qkv")
    scores = np.where(causal, np.einsum("phd,shd->hps", q, kk) / math.sqrt(q.shape[-1]), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    attn = np.einsum("hps,shd->phd", p / p.sum(-1, keepdims=True), v)
    attn = np.einsum("phd,hde->pe", attn, w["o"]) + w.get("o_bias", 0.0)
    m = layer_norm(x, w["mlp_norm"], w.get("mlp_norm_bias", 0.0), eps)
    ff = gelu_tanh(m @ w["w1"] + w.get("w1_bias", 0.0)) @ w["w2"] + w.get("w2_bias", 0.0)
    return attn, ff


def official_embedding(model, tokens):
    """x_0 = E[ids] + P[positions]."""
    x = _np(model.token_embeddings.weight, "vocab", "embed")[tokens]
    return x + _np(model.position_embeddings.weight, "position", "embed")[: len(tokens)]


def official_logits(model, ids, grid, max_period=1e4):
    c = model.config
    n, eps = c.ode.num_steps, c.layer_norm_epsilon
    x = official_embedding(model, np.asarray(ids.array))
    for k in range(n):
        t = (k + 1) / n if grid == "right" else k / n
        attn, ff = official_branches(x, official_weights(model.generator, t, c.num_frequencies, max_period), eps)
        x = x + (attn + ff) / n
    norm = model.final_norm
    x = layer_norm(x, _np(norm.weight, "embed"), 0.0 if norm.bias is None else _np(norm.bias, "embed"), eps)
    return x @ _np(model.token_embeddings.weight, "vocab", "embed").T


def official_model(n, grid, seed=0, **overrides):
    """A tiny official-variant GPT-2 DiffEqFormer whose generator parameters are all random (the official
    initialisation zeroes the norms' maps and makes the biases' maps tiny, which would hide them)."""
    config = tiny_config("gpt2", ode=OdeConfig(num_steps=n), variant="official", time_grid=grid, **overrides)
    model = tiny_model(config, seed)
    leaves, tree = jax.tree_util.tree_flatten(model.generator)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [jax.random.normal(k, x.shape) * 0.3 if eqx.is_inexact_array(x) else x for k, x in zip(keys, leaves)]
    return eqx.tree_at(lambda m: m.generator, model, jax.tree_util.tree_unflatten(tree, leaves))


@pytest.mark.parametrize("grid", ["left", "right"])
@pytest.mark.parametrize("n", [1, 4])
def test_logits_equal_the_official_equations_and_discretise_exactly(n, grid):
    model = official_model(n, grid)
    assert model.config.resolved_time_grid == grid and set(model.generator.modules) == {
        "q_k_v", "o", "w1", "w2", "attn_norm", "mlp_norm"
    }  # fmt: skip
    ids = random_tokens(model.config)["batch", 0]
    logits = eqx.filter_jit(lambda m, x: m(x))
    ours = np.asarray(logits(model, ids).rearrange(("position", "vocab")).array, np.float64)
    ref = official_logits(model, ids, grid)
    # float32 round-off: the sinusoids' arguments reach 1000 rad (time scale 1000 at t = 1), whose float32
    # rounding (~6e-5 rad) moves every W(t); measured 2.3e-5 of the logits' scale at N = 1 on the right grid
    tol = 1e-4 * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
    other = official_logits(model, ids, "left" if grid == "right" else "right")
    assert np.abs(other - ref).max() > 100 * tol  # the grid convention matters at this size
    discrete = np.asarray(logits(discretise(model, n), ids).rearrange(("position", "vocab")).array, np.float64)
    np.testing.assert_allclose(discrete, ours, rtol=0, atol=tol)


def test_time_max_period_sets_the_sinusoids_and_the_logits():
    """`time_max_period` reaches the official time features: P = 50 gives w_i = exp(-ln(50) i / F)."""
    model = official_model(4, "right", time_max_period=50.0)
    F = model.config.num_frequencies
    embed = model.generator.time_embedding
    for t in (0.25, 1.0):
        ours = np.asarray(embed(t).array, np.float64)
        # float32 sinusoids of arguments up to 1000 rad: ~1e-4 absolute
        np.testing.assert_allclose(ours, sinusoids(t, F, 50.0), rtol=0, atol=2e-4)
        assert np.abs(ours - sinusoids(t, F)).max() > 0.1  # the authors' 1e4 gives other features
    ids = random_tokens(model.config)["batch", 0]
    ours = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, ids).rearrange(("position", "vocab")).array)
    ref = official_logits(model, ids, "right", max_period=50.0)
    tol = 1e-4 * np.abs(ref).max()  # as in the test above
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
    assert np.abs(official_logits(model, ids, "right") - ref).max() > 100 * tol


def _paths(tree) -> set[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=hax.is_named_array)[0]
    return {jax.tree_util.keystr(p) for p, _ in leaves}


def test_without_biases_the_norms_have_no_shift_and_the_linears_keep_p0():
    """use_bias: false drops b_m, every norm's H_m and LN_f's bias (the authors' dynamic.py), keeps P0_m."""
    model = official_model(4, "right", use_bias=False)
    paths = _paths(model)
    modules = model.generator.modules
    assert all(m.bias is None for m in modules.values()) and model.final_norm.bias is None
    for name in ("q_k_v", "o", "w1", "w2"):
        assert f".generator.modules['{name}'].weight.bias" in paths  # P0
    assert not [p for p in paths if p.endswith(".bias") and not p.endswith(("weight.bias", "lin1.bias", "lin2.bias"))]
    with_bias = _paths(official_model(4, "right"))
    assert ".final_norm.bias" in with_bias and ".generator.modules['attn_norm'].bias" in with_bias
    ids = random_tokens(model.config)["batch", 0]
    ours = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, ids).rearrange(("position", "vocab")).array)
    ref = official_logits(model, ids, "right")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    discrete = eqx.filter_jit(lambda m, x: m(x))(discretise(model, 4), ids).rearrange(("position", "vocab")).array
    np.testing.assert_allclose(np.asarray(discrete), ours, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_default_variant_and_grid_are_pinned():
    config = tiny_config("gpt2")
    assert config.variant == "qkvflow" and config.resolved_time_grid == "left"
    assert tiny_config("gpt2", variant="official").resolved_time_grid == "right"


@pytest.mark.parametrize(
    "flavour, overrides, message",
    [
        ("llama", {"variant": "official"}, "GPT-2 flavour"),
        ("gpt2", {"time_grid": "right"}, "time_grid"),
        ("gpt2", {"variant": "official", "shared_time_mlp": True}, "shared_time_mlp"),
        ("gpt2", {"variant": "official", "ode": OdeConfig(solver="tsit5")}, "adaptive"),
    ],
)
def test_what_the_variant_does_not_do_is_refused_in_one_line(flavour, overrides, message):
    with pytest.raises(Exception) as info:
        tiny_config(flavour, **overrides)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1


def test_hugging_face_export_gives_the_jax_logits(tmp_path):
    """The discretised official model written as a transformers folder: torch's logits are JAX's."""
    import torch
    from transformers import AutoModelForCausalLM

    from qkvflow.export.hf_folder import save_hf_folder
    from tests.helpers import logit_tolerance

    model = official_model(4, "right")
    ids = random_tokens(model.config)
    save_hf_folder(discretise(model, 4), str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(ids.array))).logits.numpy()
    ours = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, ids).rearrange(("batch", "position", "vocab")).array)
    assert np.abs(theirs - ours).max() / np.abs(ours).max() < logit_tolerance(4, model.config.hidden_dim)
