"""The Depth-Adaptive Transformer's exits (qkvflow.models.related.adaptive, qkvflow.evaluation.exits) against a
float64 numpy reference written here from the equations and the parameter arrays:

    x_0 = E[tok] + P[pos];   x_n = x_{n-1} + O Attn(LN_a x_{n-1}) + W2 gelu(W1 LN_m x_{n-1} + b1) + b2
    exit n: logits = W_n LN_n(x_n);   copy-up: x_n[t] = x_{n-1}[t] once token t has exited.
"""

import haliax as hax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import pytest
from haliax import Axis
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmExample

from qkvflow.errors import UserError
from qkvflow.evaluation import exits as ex
from qkvflow.models import registry
from qkvflow.models.discrete.model import ParallelGpt2Config
from qkvflow.models.related.adaptive import AdaptiveGpt2Config, AdaptiveLMHeadModel

V, N, SEQ = 11, 3, 8
Vocab, Batch = Axis("vocab", V), Axis("batch", 2)
SHAPE = dict(max_seq_len=SEQ, hidden_dim=16, num_heads=2, num_layers=N)
# float32 round-off of the model against the float64 reference, at these sizes (values ~1)
TOL = dict(rtol=1e-5, atol=2e-5)


def build(**kw) -> AdaptiveLMHeadModel:
    import equinox as eqx

    model = AdaptiveGpt2Config(**SHAPE, **kw).build(Vocab, key=jrandom.PRNGKey(0))
    # non-trivial norms and biases, so that a mix-up of exits' norms or a missing bias shows, and
    # embeddings of std 1 rather than 0.02, so that logits are O(1) and differences between states show
    leaves = lambda m: [m.model.norm.weight, m.model.norm.bias, m.model.embed_tokens.weight]  # noqa: E731
    k1, k2 = jrandom.split(jrandom.PRNGKey(7))
    w = hax.random.normal(k1, model.config.Embed) * 0.3 + 1.0
    b = hax.random.normal(k2, model.config.Embed) * 0.3
    return eqx.tree_at(leaves, model, [w, b, model.model.embed_tokens.weight * 50.0])


@pytest.fixture(scope="module")
def tied():
    return build()


@pytest.fixture(scope="module")
def untied():
    return build(exit_heads="untied")


@pytest.fixture(scope="module")
def tokens():
    return hax.random.randint(jrandom.PRNGKey(1), (Batch, Axis("position", SEQ)), 0, V)


# --- the numpy reference ------------------------------------------------------------------------
def arr(x, *axes):
    return np.asarray(x.rearrange(axes).array if axes else x.array, dtype=np.float64)


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def params(model):
    s = model.model.layers.stacked
    a, m = s.self_attn, s.mlp
    p = {
        "E": arr(model.model.embed_tokens.weight, "vocab", "embed"),
        "P": arr(model.model.embed_positions.weight, "position", "embed"),
        "ln_a": (arr(s.attn_norm.weight), arr(s.attn_norm.bias)),
        "ln_m": (arr(s.mlp_norm.weight), arr(s.mlp_norm.bias)),
        "mlp": (
            arr(m.up_proj.weight, "layers", "embed", "mlp"), arr(m.up_proj.bias),
            arr(m.down_proj.weight, "layers", "mlp", "embed"), arr(m.down_proj.bias),
        ),
        "out_norm": (arr(model.model.norm.weight), arr(model.model.norm.bias)),
    }  # fmt: skip
    for name in "qkv":
        proj = getattr(a, f"{name}_proj")
        p[name] = (arr(proj.weight, "layers", "embed", "heads", "head_size"), arr(proj.bias))
    p["o"] = (arr(a.o_proj.weight, "layers", "heads", "head_size", "embed"), arr(a.o_proj.bias))
    heads = [(p["out_norm"], p["E"].T)] * N  # tied: the final norm and the embeddings at every exit
    if model.exit_heads is not None:
        h = model.exit_heads.stacked
        nw, nb, W = arr(h.norm.weight), arr(h.norm.bias), arr(h.proj.weight, "exits", "embed", "vocab")
        heads = [((nw[i], nb[i]), W[i]) for i in range(N - 1)] + [(p["out_norm"], p["E"].T)]
    p["heads"] = heads
    return p


def block(p, k, x):
    """Layer k (0-based) of the parallel block on x [batch, pos, embed]."""
    h = layer_norm(x, p["ln_a"][0][k], p["ln_a"][1][k])
    q, kk, v = (np.einsum("bte,ehd->bthd", h, p[n][0][k]) + p[n][1][k] for n in "qkv")
    scores = np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(q.shape[-1])
    T = x.shape[1]
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    att = np.exp(scores - scores.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", att, v)
    attn = np.einsum("bthd,hde->bte", o, p["o"][0][k]) + p["o"][1][k]
    w1, b1, w2, b2 = p["mlp"]
    m = layer_norm(x, p["ln_m"][0][k], p["ln_m"][1][k])
    return x + attn + gelu_new(m @ w1[k] + b1[k]) @ w2[k] + b2[k]


def head(p, n, x):
    (w, b), W = p["heads"][n - 1]
    return layer_norm(x, w, b) @ W


def ref_states(p, toks, exits=None):
    """x_1..x_N; with `exits` [batch, pos] a token's state is copied up above its exit."""
    x = p["E"][toks] + p["P"][None, : toks.shape[1]]
    out = []
    for k in range(N):
        y = block(p, k, x)
        x = y if exits is None else np.where((exits > k)[..., None], y, x)
        out.append(x)
    return out


def ref_ce(logits, toks):
    """-log p(next token) at every position [batch, pos] (the last one's target wraps; weighted 0)."""
    target = np.roll(toks, -1, axis=1)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, target[..., None], -1)[..., 0]


def ref_weight(toks, loss_weight=None):
    w = np.ones(toks.shape)
    w[:, -1] = 0.0
    return w if loss_weight is None else w * loss_weight


def example(toks, weight):
    return LmExample(toks, hax.named(jnp.asarray(weight, jnp.float32), toks.axes), AttentionMask.causal())


MASK = np.array([[1, 1, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0, 1, 1]], np.float64)  # loss_weight with holes


# --- config -------------------------------------------------------------------------------------
def test_defaults_and_registration():
    c = AdaptiveGpt2Config()
    assert (c.exit_heads, c.exit_training, c.mixed_samples, c.block_scheme) == ("tied", "aligned", 1, "euler")
    assert registry.family("adaptive_gpt2").config_class is AdaptiveGpt2Config
    assert not registry.is_ode(c) and c.model_type is AdaptiveLMHeadModel


@pytest.mark.parametrize(
    "key, value",
    [("exit_heads", "shared"), ("exit_training", "random"), ("mixed_samples", 0), ("block_scheme", "rk2")],
)
def test_bad_config_names_key(key, value):
    with pytest.raises(UserError, match=f"^{key}="):
        AdaptiveGpt2Config(**SHAPE, **{key: value})


# --- training losses ----------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_aligned_loss_is_mean_of_exit_losses(which, request, tokens):
    model = request.getfixturevalue(which)
    toks, p = np.asarray(tokens.array), params(model)
    w = ref_weight(toks, MASK)
    ces = [ref_ce(head(p, n, x), toks) for n, x in zip(range(1, N + 1), ref_states(p, toks))]
    expected = np.mean([np.sum(w * ce) / np.sum(w) for ce in ces])
    got = model.compute_next_token_loss(example(tokens, MASK))
    np.testing.assert_allclose(float(got.array), expected, **TOL)
    per_position = model.compute_next_token_loss(example(tokens, MASK), reduction=None, reduction_axis=())
    np.testing.assert_allclose(np.asarray(per_position.array), w * np.mean(ces, axis=0), **TOL)


def test_training_loss_goes_through_the_model(tied, tokens):
    from qkvflow.training.loss import lm_loss

    ex_ = example(tokens, MASK)
    assert float(lm_loss(tied, ex_).array) == float(tied.compute_next_token_loss(ex_).array)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_mixed_loss_matches_reference_draws(which, tokens):
    M = 2
    model = build(exit_heads=which, exit_training="mixed", mixed_samples=M)
    toks, p, key = np.asarray(tokens.array), params(model), jrandom.PRNGKey(3)
    w = ref_weight(toks, MASK)
    per_token = np.zeros(toks.shape)
    draws = []
    for k in jrandom.split(key, M):  # the documented draws: each token an exit uniform in 1..N
        e = np.asarray(jrandom.randint(k, toks.shape, 1, N + 1))
        draws.append(e)
        top = ref_states(p, toks, exits=e)[-1]
        ces = np.stack([ref_ce(head(p, n, top), toks) for n in range(1, N + 1)])
        per_token += np.take_along_axis(ces, (e - 1)[None], 0)[0] / M
    assert len({tuple(d.ravel()) for d in draws}) == M and len(np.unique(draws)) == N
    got = model.compute_next_token_loss(example(tokens, MASK), key=key)
    np.testing.assert_allclose(float(got.array), np.sum(w * per_token) / np.sum(w), **TOL)
    # without a key (evaluation) it is the aligned loss
    aligned = build(exit_heads=which).compute_next_token_loss(example(tokens, MASK))
    assert float(model.compute_next_token_loss(example(tokens, MASK)).array) == float(aligned.array)


# --- evaluation with exits ----------------------------------------------------------------------
def truncation(model, n):
    """An n-layer parallel_gpt2 holding the first n blocks (a separate model, built and called as one)."""
    import dataclasses

    small = ParallelGpt2Config(**{**SHAPE, "num_layers": n}).build(Vocab, key=jrandom.PRNGKey(9))
    layers = dataclasses.replace(
        small.model.layers,
        stacked=hax.tree_util.tree_map(lambda a: a["layers", :n], model.model.layers.stacked),
    )
    inner = dataclasses.replace(
        small.model, embed_tokens=model.model.embed_tokens, embed_positions=model.model.embed_positions,
        layers=layers, norm=model.model.norm,
    )  # fmt: skip
    return dataclasses.replace(small, model=inner)


@pytest.mark.parametrize("n", range(1, N + 1))
def test_fixed_exit_is_the_truncated_model(tied, tokens, n):
    out = tied.exit_forward(tokens, ex.fixed_exit(n))
    assert (np.asarray(out.exits.array) == n).all()
    short = truncation(tied, n)
    expected = hax.dot(short.activations(tokens), short.get_lm_head(), axis="embed")
    np.testing.assert_allclose(np.asarray(out.logits.array), np.asarray(expected.array), rtol=1e-5, atol=1e-5)
    # and the numpy reference, every token at exit n
    toks, p = np.asarray(tokens.array), params(tied)
    np.testing.assert_allclose(np.asarray(out.logits.array), head(p, n, ref_states(p, toks)[n - 1]), **TOL)


def test_exit_logits_are_the_reference_exits(untied, tokens):
    toks, p = np.asarray(tokens.array), params(untied)
    got = np.asarray(untied.exit_logits(tokens).array)
    for n, x in zip(range(1, N + 1), ref_states(p, toks)):
        np.testing.assert_allclose(got[n - 1], head(p, n, x), **TOL)


def test_halted_state_is_copied_up_and_attended(untied, tokens):
    toks, p = np.asarray(tokens.array), params(untied)
    pos = hax.arange(tokens.axes[-1])
    rule = lambda n, x, logits: hax.broadcast_to(pos == 2, tokens.axes)  # noqa: E731  position 2 exits at 1
    out = untied.exit_forward(tokens, rule)
    exits = np.where(np.arange(SEQ) == 2, 1, N)[None].repeat(2, 0)
    assert (np.asarray(out.exits.array) == exits).all()
    copied = ref_states(p, toks, exits=exits)
    assert np.array_equal(copied[-1][:, 2], copied[0][:, 2])
    logits = np.asarray(out.logits.array)
    np.testing.assert_allclose(logits[:, 2], head(p, 1, copied[0])[:, 2], **TOL)
    np.testing.assert_allclose(logits[:, 3:], head(p, N, copied[-1])[:, 3:], **TOL)
    np.testing.assert_allclose(logits[:, :2], head(p, N, ref_states(p, toks)[-1])[:, :2], **TOL)
    # later tokens attend to the copied state: they differ from the run where position 2 went on
    full = head(p, N, ref_states(p, toks)[-1])
    assert np.abs(logits[:, 3:] - full[:, 3:]).max(-1).min() > 10 * TOL["atol"]
    # and the model's own copied-up states agree
    states = untied.exit_states(tokens, exits=hax.named(jnp.asarray(exits), tokens.axes))
    np.testing.assert_array_equal(np.asarray(states.array[-1][:, 2]), np.asarray(states.array[0][:, 2]))


def reference_threshold(p, toks, tau):
    """Copy-up evaluation with the confidence rule, layer by layer, in numpy."""
    x = p["E"][toks] + p["P"][None, : toks.shape[1]]
    exited = np.zeros(toks.shape, bool)
    exit_at, out = np.full(toks.shape, N), np.zeros(toks.shape + (V,))
    for n in range(1, N + 1):
        x = np.where(exited[..., None], x, block(p, n - 1, x))
        logits = head(p, n, x)
        prob = np.exp(logits - logits.max(-1, keepdims=True))
        conf = (prob / prob.sum(-1, keepdims=True)).max(-1)
        new = ~exited if n == N else (conf > tau) & ~exited
        out[new], exit_at[new] = logits[new], n
        exited |= new
    return out, exit_at


def test_threshold_exits_at_first_confident_exit(untied, tokens):
    toks, p = np.asarray(tokens.array), params(untied)
    # a tau between the exits' confidences, so that tokens leave at different exits
    conf = [
        np.exp(lg - lg.max(-1, keepdims=True)) for lg in (head(p, n, x) for n, x in enumerate(ref_states(p, toks), 1))
    ]
    tau = float(np.median([(c / c.sum(-1, keepdims=True)).max(-1) for c in conf[:1]]))
    logits, exits = reference_threshold(p, toks, tau)
    assert len(np.unique(exits)) >= 2
    out = untied.exit_forward(tokens, ex.confidence_threshold(tau))
    np.testing.assert_array_equal(np.asarray(out.exits.array), exits)
    np.testing.assert_allclose(np.asarray(out.logits.array), logits, **TOL)


def test_confidence_rule_on_hand_built_logits():
    probs = np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.34, 0.33, 0.33]])
    logits = hax.named(jnp.log(jnp.asarray(probs, jnp.float32)), (Axis("position", 3), Vocab.resize(3)))
    assert np.asarray(ex.confidence_threshold(0.45)(1, None, logits).array).tolist() == [True, True, False]
    assert np.asarray(ex.confidence_threshold(0.5)(1, None, logits).array).tolist() == [False, True, False]


def test_exits_are_causal(untied, tokens):
    changed = hax.named(tokens.array.at[:, -1].set((tokens.array[:, -1] + 1) % V), tokens.axes)
    first = np.asarray(hax.nn.softmax(untied.exit_logits(tokens)["layers", 0], "vocab").array).max(-1)
    rule = ex.confidence_threshold(float(np.median(first)))  # tokens leave at several exits
    a, b = untied.exit_forward(tokens, rule), untied.exit_forward(changed, rule)
    assert len(np.unique(np.asarray(a.exits.array))) >= 2
    np.testing.assert_array_equal(np.asarray(a.logits.array)[:, :-1], np.asarray(b.logits.array)[:, :-1])
    np.testing.assert_array_equal(np.asarray(a.exits.array)[:, :-1], np.asarray(b.exits.array)[:, :-1])
    assert not np.array_equal(np.asarray(a.logits.array)[:, -1], np.asarray(b.logits.array)[:, -1])


def test_scores_and_fixed_exit_sums(untied, tokens):
    toks, p = np.asarray(tokens.array), params(untied)
    w = ref_weight(toks, MASK)
    lw = hax.named(jnp.asarray(MASK, jnp.float32), tokens.axes)
    per_exit = ex.summary(ex.accumulate([ex.per_exit_sums(untied, tokens, lw)]))
    for n, x in zip(range(1, N + 1), ref_states(p, toks)):
        logits = head(p, n, x)
        target = np.roll(toks, -1, 1)
        np.testing.assert_allclose(per_exit["loss"][n - 1], np.sum(w * ref_ce(logits, toks)) / w.sum(), **TOL)
        acc = np.sum(w * (logits.argmax(-1) == target)) / w.sum()
        assert per_exit["accuracy"][n - 1] == pytest.approx(acc, abs=1e-12)
        fixed = ex.summary(ex.accumulate([ex.rule_sums(untied, tokens, lw, ex.fixed_exit(n))]))
        assert fixed["avg_exit"] == n and fixed["loss"] == pytest.approx(per_exit["loss"][n - 1], rel=1e-6)


# --- FLOPs --------------------------------------------------------------------------------------
def test_flops_by_hand():
    config = AdaptiveGpt2Config(**SHAPE)  # d 16, mlp 64, 2 heads, context 8, N 3; V 11
    c = ex.ExitCosts.of(config, V)
    # one block: mlp 2*2*16*64 + qkv 2*16*48 + out 2*16*16 + attention (2*64*16 + 3*64*2 + 2*64*16)/8
    assert c.layer == 4096 + 1536 + 512 + 560 == 6704
    assert (c.copy, c.classifier, c.test) == (1024, 352, 32)
    assert c.threshold([1, 3]).tolist() == [6704 + 2 * 1024 + 352, 3 * 6704 + 3 * 352]  # 9104, 21168
    assert c.halting([1, 3]).tolist() == [6704 + 2 * 1024 + 32 + 352, 3 * 6704 + 2 * 32 + 352]
    assert c.fixed(2) == 2 * 6704 + 352
    assert ex.mean_flops([1.0, 0.0, 1.0], c.threshold) == (9104 + 21168) / 2
    base = ParallelGpt2Config(**SHAPE).flops_per_token(V, SEQ)
    assert config.flops_per_token(V, SEQ) == base + 2 * 352
    assert base == pytest.approx(c.fixed(N))


def test_generate_refuses_exits(tied):
    from qkvflow.inference.decoders import decoder_for

    with pytest.raises(UserError, match="has exits"):
        decoder_for(tied)


def test_threshold_chosen_on_selection():
    from qkvflow.bench.exits import choose_tau

    rows = [(0.5, 2.1, 1.5), (0.7, 2.019, 2.0), (0.8, 2.015, 2.2), (0.9, 2.0, 2.6)]
    result = {
        "exits": {"selection": {"loss": [3.0, 2.5, 2.0]}},
        "threshold": [{"tau": t, "selection": {"loss": loss, "avg_exit": e}} for t, loss, e in rows],
    }
    assert choose_tau(result, 0.01)["tau"] == 0.7  # within 2.02, the lowest average exit
    assert choose_tau(result, 0.0)["tau"] == 0.9
