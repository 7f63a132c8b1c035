"""Runge-Kutta blocks of the parallel model (`block_scheme`, the ODE Transformer of Li et al., 2022).

The references are written here from the paper's equations, with F(y) the block's pre-norm
increment computed from its own sub-modules (norms, attention, feed-forward: the parts the discrete
and export tests already pin); what is under test is how a scheme combines the stages.
"""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask

from qkvflow.errors import ConfigError
from qkvflow.models import registry
from tests.helpers import Vocab

EPS32 = float(np.finfo(np.float32).eps)


def model_of(scheme, flavour="gpt2", layers=2, seed=0, family="parallel"):
    config = registry.family(f"{family}_{flavour}").config_class(
        max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=layers, block_scheme=scheme, initializer_range=0.2
    )
    model = config.build(Vocab, key=jax.random.PRNGKey(seed))
    if scheme == "rk2_scalar":  # away from their initial ones, so that a swapped or dropped scalar shows
        model = eqx.tree_at(
            lambda m: m.model.layers.stacked.gamma,
            model,
            replace_fn=lambda g: g * hax.named(jnp.array([[0.7, 1.3], [1.2, 0.6]]), g.axes),
        )
    return model


def reference(model, ids, sequential=False):
    """The final hidden state by the equations, layer by layer; F is the parallel block's increment or,
    with `sequential`, GPT-2's sequential layer's: a = Attn(LN1(x)), F(x) = a + MLP(LN2(x + a))."""
    inner, config = model.model, model.config
    pos = hax.arange(config.max_Pos)
    y = inner.embed_tokens(ids)
    if inner.embed_positions is not None:
        y = y + inner.embed_positions.embed(pos)
    for block in inner.layers.unstacked():

        def F(x, block=block):
            a = block.self_attn(block.attn_norm(x), AttentionMask.causal(), pos)
            if sequential:
                x_mid = x + a  # the attention sublayer's residual output
                return (x_mid + block.mlp(block.mlp_norm(x_mid))) - x
            return a + block.mlp(block.mlp_norm(x))

        s = config.block_scheme
        if s == "euler":
            y = y + F(y)
        elif s == "rk4":
            f1 = F(y)
            f2 = F(y + 0.5 * f1)
            f3 = F(y + 0.5 * f2)
            f4 = F(y + f3)
            y = y + (f1 + 2 * f2 + 2 * f3 + f4) / 6
        else:
            f1 = F(y)
            f2 = F(y + f1)
            if s == "rk2":
                y = y + 0.5 * (f1 + f2)
            elif s == "rk2_unit":
                y = y + f1 + f2
            elif s == "rk2_scalar":
                g = np.asarray(block.gamma.array)
                y = y + float(g[0]) * f1 + float(g[1]) * f2
            elif s == "rk2_gated":
                w = np.asarray(block.gate.weight.array)  # (2, embed)
                a1, a2 = np.asarray(f1.rearrange((..., "embed")).array), np.asarray(f2.rearrange((..., "embed")).array)
                g = 1 / (1 + np.exp(-(a1 @ w[0] + a2 @ w[1] + float(block.gate.bias.array))))
                axes = f1.rearrange((..., "embed")).axes
                y = y.rearrange(axes) + hax.named(g[..., None] * a1 + (1 - g[..., None]) * a2, axes)
    return np.asarray(inner.norm(y).rearrange((..., "embed")).array)


@pytest.mark.parametrize("scheme", ["euler", "rk2", "rk2_unit", "rk2_scalar", "rk2_gated", "rk4"])
def test_each_scheme_equals_its_equations(scheme):
    """Two layers of each scheme against the explicit loop above, to float32 round-off of a few
    hundred additions at unit scale; rk2 and rk2_unit must also differ (F2 really enters)."""
    model = model_of(scheme)
    ids = hax.random.randint(jax.random.PRNGKey(1), (model.config.max_Pos,), 0, Vocab.size)
    got = np.asarray(model.activations(ids).rearrange((..., "embed")).array)
    want = reference(model, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=256 * EPS32 * max(1.0, np.abs(want).max()))
    if scheme != "euler":
        euler = model_of("euler")
        assert np.abs(np.asarray(euler.activations(ids).rearrange((..., "embed")).array) - got).max() > 1e-3


@pytest.mark.parametrize("scheme", ["rk2_gated", "rk4"])
def test_runge_kutta_blocks_are_causal(scheme):
    model = model_of(scheme, "llama")
    ids = hax.random.randint(jax.random.PRNGKey(2), (model.config.max_Pos,), 0, Vocab.size)
    changed = ids.at[model.config.max_Pos, 7].set((ids[model.config.max_Pos, 7] + 5) % Vocab.size)
    a, b = np.asarray(model(ids).array), np.asarray(model(changed).array)
    np.testing.assert_array_equal(a[:7], b[:7])
    assert np.abs(a[7:] - b[7:]).max() > 1e-4


def test_scalar_coefficients_start_at_one_and_the_gate_at_one_half():
    """The paper's initialisation: gamma = 1 (so rk2_scalar starts as rk2_unit) and the gate's bias 0."""
    config = registry.family("parallel_gpt2").config_class(
        hidden_dim=32, num_heads=4, num_layers=3, block_scheme="rk2_scalar"
    )
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(model.model.layers.stacked.gamma.array), np.ones((3, 2)))
    gated = registry.family("parallel_gpt2").config_class(
        hidden_dim=32, num_heads=4, num_layers=3, block_scheme="rk2_gated"
    )
    gate = gated.build(Vocab, key=jax.random.PRNGKey(0)).model.layers.stacked.gate
    assert gate.weight.array.shape == (3, 2, 32) and np.all(np.asarray(gate.bias.array) == 0)
    assert model.model.layers.stacked.gate is None


def test_flops_count_every_stage():
    """Levanter's count for L x stages layers (the head once), plus the gate's 2 x 2 x hidden per layer."""
    from levanter.utils.flop_utils import lm_flops_per_token

    family = registry.family("parallel_gpt2").config_class

    def layers(n):
        return lm_flops_per_token(hidden_dim=32, intermediate_dim=128, num_layers=n, num_kv_heads=4, num_heads=4,
                                  seq_len=12, vocab_size=61, glu=False)  # fmt: skip

    for scheme, stages in [("euler", 1), ("rk2", 2), ("rk2_unit", 2), ("rk2_scalar", 2), ("rk4", 4)]:
        config = family(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=3, block_scheme=scheme)
        assert config.flops_per_token(61, 12) == pytest.approx(layers(3 * stages))
    gated = family(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=3, block_scheme="rk2_gated")
    assert gated.flops_per_token(61, 12) == pytest.approx(layers(6) + 3 * 4 * 32)


def test_the_default_is_the_discretised_diffeqformer_block():
    for flavour in ("gpt2", "llama"):
        assert registry.family(f"parallel_{flavour}").config_class().block_scheme == "euler"


def test_an_unknown_scheme_names_the_key():
    with pytest.raises(ConfigError, match=r"block_scheme='rk3' is invalid: expected one of \['euler', 'rk2'"):
        registry.family("parallel_gpt2").config_class(hidden_dim=32, num_heads=4, block_scheme="rk3")


def test_the_export_refuses_a_runge_kutta_block():
    from qkvflow.errors import UserError
    from qkvflow.export.hf_folder import hf_config

    with pytest.raises(UserError, match="model.block_scheme=rk2 is not supported by the export: expected euler"):
        hf_config(model_of("rk2"))


@pytest.mark.parametrize("scheme", ["euler", "rk2", "rk2_unit", "rk2_scalar", "rk2_gated", "rk4"])
def test_each_scheme_on_the_sequential_layer_equals_its_equations(scheme):
    """`sequential_gpt2`: every stage runs the whole sequential layer (F(y) = layer(y) - y) on that
    layer's weights; and the sequential layer is not the parallel block (the feed-forward sees x + a)."""
    model = model_of(scheme, family="sequential")
    ids = hax.random.randint(jax.random.PRNGKey(1), (model.config.max_Pos,), 0, Vocab.size)
    got = np.asarray(model.activations(ids).rearrange((..., "embed")).array)
    want = reference(model, ids, sequential=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=256 * EPS32 * max(1.0, np.abs(want).max()))
    parallel = reference(model, ids, sequential=False)
    assert np.abs(parallel - got).max() > 1e-3


def test_sequential_euler_layer_is_levanters_gpt2_block():
    """The euler sequential layer, run by Levanter's own `Gpt2Block` on the same weights (q, k, v stacked
    into its c_attn), gives the same output to float32 round-off."""
    from levanter.models.gpt2 import Gpt2Block, Gpt2Config

    model = model_of("euler", family="sequential", layers=1)
    ours = next(iter(model.model.layers.unstacked()))
    config = Gpt2Config(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=1, resid_pdrop=0.0, attn_pdrop=0.0)
    lev = Gpt2Block.init(config, key=jax.random.PRNGKey(9))
    att = ours.self_attn
    qkv_w = hax.stack("qkv", [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    qkv_b = hax.stack("qkv", [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
    pairs = [
        (lambda b: b.attn.c_attn.weight, qkv_w), (lambda b: b.attn.c_attn.bias, qkv_b),
        (lambda b: b.attn.c_proj.weight, att.o_proj.weight), (lambda b: b.attn.c_proj.bias, att.o_proj.bias),
        (lambda b: b.mlp.c_fc.weight, ours.mlp.up_proj.weight), (lambda b: b.mlp.c_fc.bias, ours.mlp.up_proj.bias),
        (lambda b: b.mlp.c_proj.weight, ours.mlp.down_proj.weight), (lambda b: b.mlp.c_proj.bias, ours.mlp.down_proj.bias),
        (lambda b: b.ln_1.weight, ours.attn_norm.weight), (lambda b: b.ln_1.bias, ours.attn_norm.bias),
        (lambda b: b.ln_2.weight, ours.mlp_norm.weight), (lambda b: b.ln_2.bias, ours.mlp_norm.bias),
    ]  # fmt: skip
    for where, value in pairs:
        lev = eqx.tree_at(where, lev, value.rearrange(where(lev).axes))
    x = hax.random.normal(jax.random.PRNGKey(3), (model.config.max_Pos, model.config.Embed))
    pos = hax.arange(model.config.max_Pos)
    got = ours(x, AttentionMask.causal(), pos).rearrange((..., "embed")).array
    want = lev(x, AttentionMask.causal(), 0, key=None).rearrange((..., "embed")).array
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=64 * EPS32 * float(jnp.abs(want).max()))


def test_sequential_blocks_are_causal_and_count_their_stages():
    model = model_of("rk2", family="sequential")
    ids = hax.random.randint(jax.random.PRNGKey(2), (model.config.max_Pos,), 0, Vocab.size)
    changed = ids.at[model.config.max_Pos, 7].set((ids[model.config.max_Pos, 7] + 5) % Vocab.size)
    a, b = np.asarray(model(ids).array), np.asarray(model(changed).array)
    np.testing.assert_array_equal(a[:7], b[:7])
    assert np.abs(a[7:] - b[7:]).max() > 1e-4
    seq = registry.family("sequential_gpt2").config_class
    par = registry.family("parallel_gpt2").config_class
    for scheme in ("euler", "rk2", "rk4"):  # the parallel count, pinned stage by stage above
        kw = dict(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=3, block_scheme=scheme)
        assert seq(**kw).flops_per_token(61, 12) == par(**kw).flops_per_token(61, 12)


def test_the_export_refuses_a_sequential_layer():
    from qkvflow.errors import UserError
    from qkvflow.export.hf_folder import hf_config

    with pytest.raises(UserError, match="model.type=sequential_gpt2 is not supported by the export"):
        hf_config(model_of("euler", family="sequential"))
