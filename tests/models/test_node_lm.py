"""The `node_transformer` family (the N-ODE Transformer as a causal LM) against a reference written here
from the paper's equations: numpy attention with d/2 heads of size 2, a causal mask, eq. 5's affine maps,
and a fine classical RK4 for each block."""

import dataclasses
import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haliax import Axis
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmExample

from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.models.related.node_lm import NodeTransformerLmConfig, NodeTransformerLMHeadModel
from qkvflow.training.loss import lm_loss

D, N, V = 8, 8, 11
Batch, Pos = Axis("batch", 2), Axis("position", N)


def affine(p, x, t):
    """Eq. 5: x A + b + c t (b, c only where present)."""
    y = x @ np.asarray(p["A"], np.float64)
    y = y + np.asarray(p["b"]) if "b" in p else y
    return y + np.asarray(p["c"]) * t if "c" in p else y


def causal_field(block, x, t):
    """X' = FFN_t(X + MHSA_t(X)) (alpha = 1), heads of size 2, query i sees keys j <= i."""
    q, k, v = (affine(block[name], x, t).reshape(N, D // 2, 2) for name in "qkv")
    s = np.einsum("ihc,jhc->hij", q, k) / math.sqrt(2.0)
    s = np.where(np.tril(np.ones((N, N), bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    att = np.einsum("hij,jhc->ihc", w, v).reshape(N, D)
    z = x + affine(block["o"], att, t)
    return affine(block["ff2"], np.maximum(affine(block["ff1"], z, t), 0.0), t)


def rk4_block(block, x, steps=64):
    """X(1) and int_0^1 ||X'||_F^2 dt (Simpson's weights on the RK4 stages)."""
    h, energy = 1.0 / steps, 0.0
    for i in range(steps):
        t = i * h
        k1 = causal_field(block, x, t)
        k2 = causal_field(block, x + h / 2 * k1, t + h / 2)
        k3 = causal_field(block, x + h / 2 * k2, t + h / 2)
        k4 = causal_field(block, x + h * k3, t + h)
        energy += h / 6 * ((k1**2).sum() + 2 * (k2**2).sum() + 2 * (k3**2).sum() + (k4**2).sum())
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x, energy


def positions():
    pe = np.zeros((N, D))
    for p in range(N):
        for i in range(0, D, 2):
            pe[p, i], pe[p, i + 1] = math.sin(p / 10000 ** (i / D)), math.cos(p / 10000 ** (i / D))
    return pe


def reference(params, tokens):
    """Logits [N, V] and (1/L) sum_blocks int ||X'||^2 of one sequence."""
    x = np.asarray(params["embed"], np.float64)[tokens] + positions()
    total = 0.0
    for block in params["blocks"]:
        x, e = rk4_block(block, x)
        total += e
    hidden = np.maximum(affine(params["head1"], x, 0.0), 0.0)
    return affine(params["head2"], hidden, 0.0), total / N


@pytest.fixture(scope="module")
def model():
    config = NodeTransformerLmConfig(max_seq_len=N, hidden_dim=D, num_blocks=2)
    m = config.build(Axis("vocab", V), key=jax.random.PRNGKey(0))
    # nonzero biases and time coefficients, so that b and c t are exercised
    leaves, tree = jax.tree_util.tree_flatten(m.params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [leaf + 0.3 * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys)]
    return eqx.tree_at(lambda mm: mm.params, m, jax.tree_util.tree_unflatten(tree, noisy))


logits_of = eqx.filter_jit(lambda m, t: m(t))  # one compile serves every call of the same shapes
flow_of = eqx.filter_jit(lambda m, t: m.flow(t))


@pytest.fixture(scope="module")
def tokens():
    return hax.named(jax.random.randint(jax.random.PRNGKey(2), (2, N), 0, V), (Batch, Pos))


def test_family_is_declared_with_the_papers_defaults():
    fam = registry.family("node_transformer")
    assert fam.model_class is NodeTransformerLMHeadModel and not fam.ode
    c = NodeTransformerLmConfig()
    assert (c.hidden_dim, c.num_blocks, c.alpha, c.solver, c.rtol, c.atol, c.kinetic_weight) == (
        8, 2, 1, "tsit5", 1e-5, 1e-5, 0.0
    )  # fmt: skip
    assert c.node.num_heads == 4 and c.node.causal and not c.time_attention


def test_logits_and_energy_match_reference(model, tokens):
    logits = logits_of(model, tokens)
    assert logits.axes == (Batch, Pos, model.Vocab)
    _, energy, stats = flow_of(model, tokens)
    want = [reference(model.raw_params, np.asarray(tokens.array[b])) for b in range(2)]
    # adaptive tsit5 at rtol = atol = 1e-5 against a fine RK4: agreement at the tolerance's level
    np.testing.assert_allclose(np.asarray(logits.array), np.stack([w[0] for w in want]), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(float(energy), np.mean([w[1] for w in want]), rtol=1e-3)
    assert float(stats.nfe) > 0


def test_causal_up_to_the_solver_tolerance(model, tokens):
    """A later token never reaches an earlier state through the field; it does change the sequence's shared
    adaptive grid, so earlier logits move, but only at the tolerance's level."""
    moved = tokens.array.at[:, 5].set((tokens.array[:, 5] + 1) % V)
    base, other = logits_of(model, tokens).array, logits_of(model, hax.named(moved, (Batch, Pos))).array
    np.testing.assert_allclose(np.asarray(other[:, :5]), np.asarray(base[:, :5]), rtol=1e-3, atol=1e-3)
    assert np.abs(np.asarray(other[:, 5:] - base[:, 5:])).max() > 1e-2


def test_train_step_lowers_loss_and_reports_solver_metrics(model, tokens):
    """lm_loss = next-token CE + lambda/2 * E with `ode_*` metrics; one SGD step lowers it."""
    lam = 0.5
    m = dataclasses.replace(model, _config=NodeTransformerLmConfig(max_seq_len=N, kinetic_weight=lam))
    weight = hax.broadcast_to(LmExample.causal_loss_mask(Pos), (Batch, Pos)).astype(jnp.float32)
    example = LmExample(tokens=tokens, loss_weight=weight, attn_mask=AttentionMask.causal())

    def scalar_loss(mm):
        loss, metrics = lm_loss(mm, example)
        return loss.scalar(), metrics

    @eqx.filter_jit
    def loss_and_grad(mm):
        (loss, metrics), grads = eqx.filter_value_and_grad(scalar_loss, has_aux=True)(mm)
        return loss, metrics, grads

    loss, metrics, grads = loss_and_grad(m)
    logp = jax.nn.log_softmax(np.asarray(logits_of(m, tokens).array, np.float64), -1)
    ce = -np.mean(np.take_along_axis(logp[:, :-1], np.asarray(tokens.array)[:, 1:, None], -1))
    energy = float(metrics["ode_kinetic_energy"].value())
    np.testing.assert_allclose(float(loss), ce + 0.5 * lam * energy, rtol=1e-4)
    assert float(metrics["ode_nfe"].value()) >= 12 and float(metrics["ode_steps"].value()) >= 2
    stepped = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, m, grads)
    assert float(loss_and_grad(stepped)[0]) < float(loss)
    # the last position has no next token: its weight is 0 (the CE above averages positions 0..N-2)
    assert float(weight.array[0, -1]) == 0.0


@pytest.mark.parametrize(
    "key,value", [("hidden_dim", 7), ("num_blocks", 0), ("alpha", 2), ("solver", "euler"), ("kinetic_weight", -1.0)]
)
def test_bad_config_names_key(key, value):
    with pytest.raises(UserError, match=f"model.{key}") as err:
        NodeTransformerLmConfig(**{key: value})
    assert "\n" not in str(err.value)
