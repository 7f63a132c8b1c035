"""TransEvolve (Dutta et al., 2021; qkvflow.models.related.transevolve) against its equations.

The references are written here in numpy float64 from the paper's equations: the attention logits
with all four terms of Eq. 6, A0 + A1 T + T A2 + A3 (T, T), computed from the model's own parameter
arrays (W_KT included, although the model never uses it), the causal softmax, the layer update
H = softmax(a) LN(X) W_o + b_o + X and GPT-2's pre-norm FFN. The random FFN's U, V are generated here
by the documented recipe, not by the model's function.
"""

import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from haliax import Axis
from levanter.layers.attention import AttentionMask

from qkvflow.errors import ConfigError, UserError
from qkvflow.models import accounting, registry
from qkvflow.models.related.transevolve import TransEvolveConfig, random_factors
from tests.helpers import Vocab

EPS32 = float(np.finfo(np.float32).eps)
Batch = Axis("batch", 2)


def config_of(**overrides):
    # gradient checkpointing changes no value, only what the backward pass recomputes (and its compile time)
    kwargs = dict(max_seq_len=8, hidden_dim=16, num_heads=2, num_layers=4, num_blocks=2, ffn="full")
    kwargs["gradient_checkpointing"] = False
    kwargs.update(overrides)
    return TransEvolveConfig(**kwargs)


def perturbed(model, seed=0):
    """Every parameter moved off its initial value (norm scales off 1, biases off 0, amplitudes off 1),
    so that a swapped norm, a dropped bias or a wrong amplitude shows."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(leaves)))
    out = []
    for leaf in leaves:
        if eqx.is_inexact_array(leaf):
            noise = jax.random.normal(next(keys), leaf.shape, leaf.dtype)
            leaf = leaf * (1 + 0.3 * noise) + 0.2 * jnp.roll(noise, 1)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def build(seed=0, **overrides):
    config = config_of(**overrides)
    return perturbed(config.build(Vocab, key=jax.random.PRNGKey(seed)), seed)


@pytest.fixture(scope="module")
def full_model():
    return build(ffn="full")


@pytest.fixture(scope="module")
def random_model():
    return build(ffn="random")


def tokens(config, seed=1):
    return hax.random.randint(jax.random.PRNGKey(seed), (Batch, config.max_Pos), 0, Vocab.size)


# --- the reference, from the equations ------------------------------------------------------------
def arr(named, *axes):
    return np.asarray(named.rearrange(axes).array, np.float64)


def layer_norm(x, norm, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * arr(norm.weight, "embed") + arr(norm.bias, "embed")


def gelu_new(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def linear(x, lin, out_axes):
    """x (..., embed) through an embed -> out_axes Linear: (..., *out)."""
    w = arr(lin.weight, "embed", *out_axes)
    y = np.tensordot(x, w, axes=([-1], [0]))
    return y if lin.bias is None else y + arr(lin.bias, *out_axes)


def depth_vector(amplitude, depth, period):
    c = np.arange(amplitude.size)
    angle = np.pi * depth * c / period
    return amplitude * np.where(c % 2 == 0, np.sin(angle), np.cos(angle))


def four_term_logits(block, h0, depth, config):
    """a^l (batch, heads, query, key) = (A0 + A1 T + T A2 + A3 (T, T)) / sqrt(head_size), all four terms."""
    hs = config.hidden_dim // config.num_heads
    T = depth_vector(arr(block.depth_amplitude, "embed"), depth, config.depth_period)
    q0 = linear(h0, block.q_proj, ("heads", "head_size"))  # (b, n, h, hs)
    k0 = linear(h0, block.k_proj, ("heads", "head_size"))
    qT = np.tensordot(T, arr(block.q_depth.weight, "embed", "heads", "head_size"), 1)  # (h, hs)
    kT = np.tensordot(T, arr(block.k_depth.weight, "embed", "heads", "head_size"), 1)
    a0 = np.einsum("bihd,bjhd->bhij", q0, k0)
    a1 = np.einsum("bihd,hd->bhi", q0, kT)[..., :, None]  # query-dependent, constant along keys
    a2 = np.einsum("hd,bjhd->bhj", qT, k0)[..., None, :]  # key-dependent
    a3 = np.einsum("hd,hd->h", qT, kT)[None, :, None, None]
    return (a0 + a1 + a2 + a3) / math.sqrt(hs), (a1, a3)


def causal_softmax(a):
    n = a.shape[-1]
    a = np.where(np.tril(np.ones((n, n), bool)), a, -np.inf)
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attention_update(layer, block, h0, x, depth, config):
    """H^l = softmax(a^l) LN_a(X^l) W_o + b_o + X^l, values = each head's slice of LN_a(X^l)."""
    p = causal_softmax(four_term_logits(block, h0, depth, config)[0])
    v = layer_norm(x, layer.attn_norm, config.layer_norm_epsilon).reshape(*x.shape[:-1], config.num_heads, -1)
    out = np.einsum("bhij,bjhd->bihd", p, v)
    w_o = arr(layer.o_proj.weight, "heads", "head_size", "embed")
    return np.einsum("bihd,hde->bie", out, w_o) + arr(layer.o_proj.bias, "embed") + x


def documented_factors(config, index):
    """U_1, V_1, U_2, V_2 by the documented recipe: N(0, 1) / sqrt(rows), key fold_in(seed, layer) split in 4."""
    d, m = config.hidden_dim, config.mlp_dim
    r = min(d, m)
    keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(config.random_ffn_seed), index), 4)
    shapes = [(d, r), (r, m), (m, r), (r, d)]
    return [np.asarray(jax.random.normal(k, s), np.float64) / math.sqrt(s[0]) for k, s in zip(keys, shapes)]


def ffn(layer, m, index, config):
    mlp = layer.mlp
    if config.ffn == "full":
        h = gelu_new(linear(m, mlp.up_proj, ("mlp",)))
        w2 = arr(mlp.down_proj.weight, "mlp", "embed")
        return h @ w2 + arr(mlp.down_proj.bias, "embed")
    u1, v1, u2, v2 = documented_factors(config, index)
    w1 = u1 @ np.diag(arr(mlp.up_sigma, "rank")) @ v1
    w2 = u2 @ np.diag(arr(mlp.down_sigma, "rank")) @ v2
    h = gelu_new(m @ w1 + arr(mlp.up_bias, "mlp"))
    return h @ w2 + arr(mlp.down_bias, "embed")


def reference_logits(model, ids):
    config = model.config
    ids = np.asarray(ids.rearrange(("batch", "position")).array)
    x = arr(model.embed_tokens.weight, "vocab", "embed")[ids] + arr(model.embed_positions.weight, "position", "embed")
    for b, block in enumerate(model.blocks):
        h0 = layer_norm(x, block.qk_norm, config.layer_norm_epsilon)
        for depth, layer in enumerate(block.layers.unstacked()):
            h = attention_update(layer, block, h0, x, depth, config)
            m = layer_norm(h, layer.mlp_norm, config.layer_norm_epsilon)
            x = h + ffn(layer, m, b * config.layers_per_block + depth, config)
    x = layer_norm(x, model.norm, config.layer_norm_epsilon)
    return x @ arr(model.embed_tokens.weight, "vocab", "embed").T  # tied unembedding


@eqx.filter_jit
def _logits(model, ids):
    return model(ids).rearrange(("batch", "position", "vocab")).array


def got_logits(model, ids):
    return np.asarray(_logits(model, ids), np.float64)


def tolerance(want, config):
    """float32 against float64: a few ulps per sum of ~hidden terms (random walk), accumulated over the
    layers and the head, relative to the largest value; 8 as a margin. At 4 layers x hidden 16 that is
    64 ulps of the largest logit; measured: 4.5 (full FFN) and 6.0 (random FFN) ulps."""
    return 8 * EPS32 * math.sqrt(config.num_layers * config.hidden_dim) * max(1.0, np.abs(want).max())


# --- tests ---------------------------------------------------------------------------------------
def test_attention_with_the_key_bias_equals_the_four_term_logits(full_model):
    """One block of 2 layers (depths 0 and 1) with its FFNs switched off (down projection zero): every
    layer is exactly H^l = softmax(A0 + A1 T + T A2 + A3 (T, T)) LN(X^l) W_o + b_o + X^l. The two terms
    that cancel are far from zero here, so the equality is the cancellation, not two small terms."""
    block = full_model.blocks[1]
    mlp = block.layers.stacked.mlp
    block = eqx.tree_at(
        lambda b: (b.layers.stacked.mlp.down_proj.weight, b.layers.stacked.mlp.down_proj.bias),
        block,
        (mlp.down_proj.weight * 0, mlp.down_proj.bias * 0),
    )
    config = full_model.config
    x = np.random.default_rng(0).normal(size=(Batch.size, config.max_seq_len, config.hidden_dim))
    h0 = layer_norm(x, block.qk_norm, config.layer_norm_epsilon)
    want = x
    for depth, layer in enumerate(block.layers.unstacked()):
        a1, a3 = four_term_logits(block, h0, depth, config)[1]
        assert np.abs(a1).max() > 0.5 and np.abs(a3).max() > 0.1
        want = attention_update(layer, block, h0, want, depth, config)
    x_named = hax.named(jnp.asarray(x, jnp.float32), (Batch, config.max_Pos, config.Embed))
    got = eqx.filter_jit(
        lambda blk, x: blk(x, AttentionMask.causal(), 0).rearrange(("batch", "position", "embed")).array
    )(block, x_named)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tolerance(want, config))


@pytest.mark.parametrize("ffn_kind", ["full", "random"])
def test_forward_pass_equals_the_equations(ffn_kind, request):
    """2 blocks x 2 layers, embeddings to tied logits, against the loop above."""
    model = request.getfixturevalue(f"{ffn_kind}_model")
    ids = tokens(model.config)
    want = reference_logits(model, ids)
    np.testing.assert_allclose(got_logits(model, ids), want, rtol=0, atol=tolerance(want, model.config))


def test_changing_a_later_token_leaves_earlier_logits_bit_identical(random_model):
    model = random_model
    ids = tokens(model.config)
    changed = ids.at[Batch, 0, model.config.max_Pos, 5].set((ids[Batch, 0, model.config.max_Pos, 5] + 7) % Vocab.size)
    a, b = got_logits(model, ids), got_logits(model, changed)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[0, 5:] - b[0, 5:]).max() > 1e-3


def loss_of(model, ids):
    logits = model(ids).array
    target = ids.array[:, 1:]
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    return -jnp.take_along_axis(logp, target[..., None], -1).mean()


def test_random_ffn_trains_sigma_and_biases_only_and_its_factors_are_no_parameters(random_model):
    model, config = random_model, random_model.config
    mlp = model.blocks[0].layers.stacked.mlp
    leaves = {name: getattr(mlp, name) for name in ("up_sigma", "up_bias", "down_sigma", "down_bias")}
    assert {k: v.array.shape for k, v in leaves.items()} == {
        "up_sigma": (2, 16), "up_bias": (2, 64), "down_sigma": (2, 16), "down_bias": (2, 16)
    }  # fmt: skip
    assert len(jax.tree_util.tree_leaves(eqx.filter(mlp, eqx.is_array))) == 4
    factor_shapes = {(16, 16), (16, 64), (64, 16)}
    for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)):
        assert leaf.shape[-2:] not in factor_shapes or leaf.ndim > 3  # no U or V anywhere (stacked or not)

    ids = tokens(config)
    grads = eqx.filter_jit(eqx.filter_grad(loss_of))(model, ids)
    g = grads.blocks[0]
    assert np.abs(np.asarray(g.layers.stacked.mlp.up_sigma.array)).max() > 0
    assert np.abs(np.asarray(g.q_depth.weight.array)).max() > 0
    np.testing.assert_array_equal(np.asarray(g.k_depth.weight.array), 0.0)  # W_KT cancels: no gradient at all

    @eqx.filter_jit
    def adamw_step(model, grads):
        opt = optax.adamw(1e-2)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, _ = opt.update(grads, opt.init(params), params)
        return eqx.apply_updates(model, updates)

    stepped = adamw_step(model, grads)
    new = stepped.blocks[0].layers.stacked.mlp
    for name in leaves:
        assert np.abs(np.asarray(getattr(new, name).array - leaves[name].array)).min() > 0, name
    # after the step the FFN still uses the same fixed U, V: the stepped model equals the equations with them
    want = reference_logits(stepped, ids)
    np.testing.assert_allclose(got_logits(stepped, ids), want, rtol=0, atol=tolerance(want, config))


def test_random_factors_are_deterministic_and_pinned():
    """Same seed and layer: the same matrices on every call and in every process (values pinned, computed
    once with jax 0.10.2's threefry); another layer or seed: other matrices."""
    config = config_of(ffn="random")
    first, again = random_factors(config, 3), random_factors(config, 3)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(first[0][0, :3]), PINNED_U1_ROW0, rtol=4 * EPS32)
    np.testing.assert_allclose(np.asarray(first[3][-1, -3:]), PINNED_V2_LAST, rtol=4 * EPS32)
    other_layer = random_factors(config, 4)[0]
    other_seed = random_factors(config_of(ffn="random", random_ffn_seed=1), 3)[0]
    assert np.abs(np.asarray(other_layer - first[0])).max() > 0.1
    assert np.abs(np.asarray(other_seed - first[0])).max() > 0.1
    u1 = np.asarray(random_factors(config_of(ffn="random", hidden_dim=64, num_heads=2), 0)[0])
    assert abs(u1.std() * math.sqrt(64) - 1) < 0.05  # N(0, 1) / sqrt(fan_in)


PINNED_U1_ROW0 = [0.4204554259777069, 0.1664751172065735, -0.05099833384156227]
PINNED_V2_LAST = [-0.3914896845817566, 0.1778935045003891, 0.3960092067718506]


def test_parameters_are_counted_from_shapes():
    """accounting.count (what `qkvflow describe` reports) against a count by hand: U, V are not in it."""
    d, m, n, V = 16, 64, 8, Vocab.size
    per_block = 2 * d + 2 * (d * d + d) + 2 * d * d + d  # qk_norm, W_Q/b_Q, W_K/b_K, W_QT, W_KT, amplitudes
    full_ffn, random_ffn = 2 * d * m + m + d, 2 * d + m + d
    per_layer = 4 * d + d * d + d  # two norms, W_o and b_o
    outside = V * d + n * d + 2 * d  # tokens, positions, final norm; the head is tied
    for kind, ffn_params in (("full", full_ffn), ("random", random_ffn)):
        config = config_of(ffn=kind)
        want = outside + 2 * per_block + 4 * (per_layer + ffn_params)
        assert accounting.count(accounting.model_shapes(config, V)) == want


def test_flops_per_token():
    """By hand at hidden 16, 2 heads (head 8), mlp 64, context 8, vocab 61, 2 blocks of 2 layers."""
    d, h, hs, m, n, V = 16, 2, 8, 64, 8, 61
    block = 4 * d * d + 2 * d
    attn = 2 * n * h * (hs + 1) + 3 * n * h + 2 * n * d + 2 * d * d
    full = 2 * block + 4 * (attn + 4 * d * m) + 2 * d * V
    random = 2 * block + 4 * (attn + 2 * (d * d + d * m) * 2) + 2 * d * V
    assert config_of(ffn="full").flops_per_token(V, n) == full
    assert config_of(ffn="random").flops_per_token(V, n) == random


def test_defaults_are_pinned():
    c = TransEvolveConfig()
    assert (c.max_seq_len, c.hidden_dim, c.num_heads, c.num_layers, c.num_blocks) == (1024, 768, 12, 12, 1)
    assert (c.ffn, c.intermediate_dim, c.mlp_dim, c.random_ffn_seed, c.depth_period) == ("full", None, 3072, 0, 64.0)
    assert (c.initializer_range, c.layer_norm_epsilon, c.activation_function.value) == (0.02, 1e-5, "gelu_new")
    assert c.gradient_checkpointing and c.attn_backend is None
    family = registry.family("transevolve_gpt2")
    assert family.config_class is TransEvolveConfig and not family.ode and family.discretises_to is None
    model = config_of().build(Vocab, key=jax.random.PRNGKey(0))
    assert model.get_lm_head() is model.embed_tokens.weight  # tied
    np.testing.assert_array_equal(np.asarray(model.blocks[0].depth_amplitude.array), 1.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_layers=6, num_blocks=4), "num_blocks=4 is invalid: expected a divisor of num_layers=6"),
        (dict(ffn="randomFF"), "ffn='randomFF' is invalid: expected one of ['full', 'random']"),
        (dict(num_heads=3), "num_heads=3 is invalid: expected a divisor of hidden_dim=16"),
        (dict(num_blocks=0), "num_blocks=0 is invalid: expected an integer >= 1"),
        (dict(depth_period=0.0), "depth_period=0.0 is invalid: expected a number > 0"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        config_of(**overrides)
    assert str(e.value) == message and isinstance(e.value, UserError)


def test_generate_refuses_in_one_line(full_model):
    from qkvflow.inference.decoders import decoder_for

    with pytest.raises(UserError) as e:
        decoder_for(full_model)
    assert "TransEvolveLMHeadModel has no KV-cached decoding" in str(e.value) and "\n" not in str(e.value)
