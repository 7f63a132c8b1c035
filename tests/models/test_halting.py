"""Halting of the Depth-Adaptive Transformer (Elbayad et al., 2020): `qkvflow.models.related.halting`.

References are written here from the paper's equations (numpy loops over exits and positions) or by
hand; what is under test is the module's vectorised haliax version.
"""

import math

import haliax as hax
import jax
import numpy as np
import pytest

from qkvflow.errors import UserError
from qkvflow.models.related import halting as H

Exit = hax.Axis("exit", 4)
Pos = hax.Axis("position", 5)
Batch = hax.Axis("batch", 2)
Embed = hax.Axis("embed", 8)
Vocab = hax.Axis("vocab", 7)
EPS32 = float(np.finfo(np.float32).eps)


def logit(p):
    p = np.asarray(p, dtype=np.float64)
    return np.log(p) - np.log1p(-p)


def geometric_q_reference(chi):
    """q(n) = chi_n prod_{n'<n} (1 - chi_n') for n < N, q(N) = prod_{n'<N} (1 - chi_n'): a loop."""
    chi = np.asarray(chi, dtype=np.float64)
    q = np.zeros_like(chi)
    for idx in np.ndindex(chi.shape[:-1]):
        row, survive = chi[idx], 1.0
        for n in range(chi.shape[-1]):
            q[idx + (n,)] = survive * (row[n] if n < chi.shape[-1] - 1 else 1.0)
            survive *= 1.0 - row[n]
    return q


def test_defaults_pinned():
    c = H.HaltingConfig()
    assert (c.kind, c.oracle, c.lam, c.sigma, c.alpha, c.tau) == ("none", "correctness", 0.1, 1.0, 1.0, 0.5)


@pytest.mark.parametrize(
    "key, value",
    [("kind", "adaptive"), ("oracle", "entropy"), ("lam", -0.1), ("sigma", 0.0), ("sigma", -1.0)]
    + [("alpha", 0.0), ("tau", 0.0), ("tau", 1.0), ("tau", 1.5)],
)
def test_bad_config_values_name_the_key(key, value):
    with pytest.raises(UserError, match=f"halting.{key}="):
        H.HaltingConfig(**{key: value})


def test_bad_values_in_the_functions_name_the_key():
    z, s = hax.zeros((Pos, Exit)), hax.zeros((Pos, Exit))
    with pytest.raises(UserError, match="halting.tau="):
        H.geometric_exit(z, Exit, 1.0)
    with pytest.raises(UserError, match="halting.lam="):
        H.oracle_exit(s, Exit, Pos, lam=-1.0, sigma=1.0)
    with pytest.raises(UserError, match="halting.sigma="):
        H.oracle_exit(s, Exit, Pos, lam=0.1, sigma=0.0)
    with pytest.raises(UserError, match="halting.kind="):
        H.HaltingHead.init("none", Exit, Embed, key=jax.random.PRNGKey(0))


def test_geometric_q_on_hand_built_chi():
    chi = np.array([0.2, 0.5, 0.9, 0.3])  # chi_N = 0.3 must not matter
    q = np.exp(H.geometric_log_q(hax.named(logit(chi).astype(np.float32), Exit), Exit).array)
    by_hand = np.array([0.2, 0.8 * 0.5, 0.8 * 0.5 * 0.9, 0.8 * 0.5 * 0.1])
    np.testing.assert_allclose(q, by_hand, rtol=8 * EPS32)
    np.testing.assert_allclose(q.sum(), 1.0, rtol=8 * EPS32)


def test_geometric_q_matches_the_product_formula_and_sums_to_one():
    chi = np.random.default_rng(0).uniform(0.02, 0.98, size=(Batch.size, Pos.size, Exit.size))
    scores = hax.named(logit(chi).astype(np.float32), (Batch, Pos, Exit))
    q = np.exp(H.geometric_log_q(scores, Exit).array)
    np.testing.assert_allclose(q, geometric_q_reference(chi), rtol=16 * EPS32, atol=0)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=8 * EPS32)


def test_geometric_exit_is_the_first_test_above_tau():
    chi = np.array(
        [
            [0.2, 0.6, 0.9, 0.1],  # first above 0.5: exit 2
            [0.1, 0.2, 0.3, 0.99],  # none of the first three: the last exit
            [0.5, 0.5, 0.7, 0.01],  # exactly tau does not stop: exit 3
            [0.9, 0.1, 0.1, 0.1],  # exit 1
            [0.3, 0.8, 0.95, 0.2],  # exit 2 at tau 0.5, exit 3 at tau 0.85
        ]
    )
    scores = hax.named(logit(chi).astype(np.float32), (Pos, Exit))
    np.testing.assert_array_equal(H.geometric_exit(scores, Exit, 0.5).array, [1, 3, 2, 0, 1])
    np.testing.assert_array_equal(H.geometric_exit(scores, Exit, 0.85).array, [2, 3, 3, 0, 2])


def test_multinomial_q_and_argmax_ties_to_the_earliest_exit():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.5, -1.0, 2.0, 1.0]], dtype=np.float32)
    named = hax.named(logits, (Batch, Exit))
    log_q = H.multinomial_log_q(named, Exit).array
    reference = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_q, reference, rtol=4 * EPS32, atol=4 * EPS32)
    np.testing.assert_array_equal(H.multinomial_exit(named, Exit).array, [1, 2])


@pytest.mark.parametrize("kind", ["geometric", "multinomial"])
def test_head_reads_the_states_as_the_equations_say(kind):
    head = H.HaltingHead.init(kind, Exit, Embed, key=jax.random.PRNGKey(0), init_scale=0.5)
    head = jax.tree_util.tree_map(lambda x: x + 0.1, head)  # a nonzero bias
    h = np.random.default_rng(1).normal(size=(Pos.size, Exit.size, Embed.size)).astype(np.float32)
    states = hax.named(h, (Pos, Exit, Embed))
    W = np.asarray(head.proj.weight.array, dtype=np.float64).reshape(-1, Embed.size)
    b = np.asarray(head.proj.bias.array, dtype=np.float64).reshape(-1)
    log_q = head.log_q(states).rearrange((Pos, Exit)).array
    if kind == "geometric":  # chi_n = sigmoid(w . h_n + b)
        chi = 1.0 / (1.0 + np.exp(-(h.astype(np.float64) @ W[0] + b[0])))
        reference = geometric_q_reference(chi)
        first = np.array([next((n for n in range(3) if row[n] > 0.5), 3) for row in chi])
    else:  # q = softmax(W h_1 + b)
        z = h[:, 0].astype(np.float64) @ W.T + b
        reference = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        first = z.argmax(-1)
    np.testing.assert_allclose(np.exp(log_q), reference, rtol=1e-5)  # d = 8 float32 dot products
    np.testing.assert_array_equal(head.exit(states).array, first)
    if kind == "multinomial":  # only h_1 is read
        moved = states.at["exit", 1:].set(0.0)
        np.testing.assert_array_equal(head.log_q(moved).array, head.log_q(states).array)


# --- oracles ----------------------------------------------------------------------------------

# a hand-built LL table: 3 positions x 3 exits
LL = np.array([[-2.0, -1.0, -0.9], [-1.0, -1.0, -1.0], [-1.0, -0.5, -3.0]], dtype=np.float32)
E3, P3 = hax.Axis("exit", 3), hax.Axis("position", 3)
NO_SMOOTHING = 1e-3  # kappa at distance 1: exp(-1000) = 0 in float32


@pytest.mark.parametrize(
    "lam, expected",
    [
        (0.0, [2, 0, 1]),  # argmax LL; row 2 all equal: the earliest exit
        (0.2, [1, 0, 1]),  # -2.2, -1.4, -1.5: one exit earlier for row 1
        (0.5, [1, 0, 0]),  # row 3: -1.5 = -1.5, a tie, resolved to the earliest
        (1.2, [0, 0, 0]),  # -3.2, -3.4, -4.5
    ],
)
def test_likelihood_oracle_by_hand(lam, expected):
    table = hax.named(LL, (P3, E3))
    np.testing.assert_array_equal(H.oracle_exit(table, E3, P3, lam=lam, sigma=NO_SMOOTHING).array, expected)


def smoothed_reference(S, m, sigma):
    """S~_t = sum_t' kappa(t,t') m_t' S_t' / sum_t' kappa(t,t') m_t', kappa = exp(-(t-t')^2/sigma), loops."""
    T = S.shape[0]
    out = np.zeros_like(S, dtype=np.float64)
    for t in range(T):
        num, den = 0.0, 0.0
        for u in range(T):
            k = math.exp(-((t - u) ** 2) / sigma)
            num, den = num + k * m[u] * S[u].astype(np.float64), den + k * m[u]
        out[t] = num / den
    return out


def test_smoothing_at_the_edges_and_masked_positions():
    S = np.random.default_rng(2).normal(size=(Pos.size, Exit.size)).astype(np.float32)
    m = np.array([1.0, 1.0, 1.0, 1.0, 0.0], dtype=np.float32)  # the last position has no target
    got = H.smooth_over_positions(hax.named(S, (Pos, Exit)), Pos, 1.0, hax.named(m, Pos)).array
    np.testing.assert_allclose(got, smoothed_reference(S, m, 1.0), rtol=1e-6, atol=1e-6)
    # by hand at the first position: weights 1, e^-1, e^-4, e^-9 over positions 0..3 (4 is masked)
    k = np.exp(-np.array([0.0, 1.0, 4.0, 9.0]))
    np.testing.assert_allclose(got[0], (k[:, None] * S[:4]).sum(0) / k.sum(), rtol=1e-6, atol=1e-6)
    # a masked position's score does not reach its neighbours
    moved = S.copy()
    moved[4] = 1e3
    again = H.smooth_over_positions(hax.named(moved, (Pos, Exit)), Pos, 1.0, hax.named(m, Pos)).array
    np.testing.assert_array_equal(again[:4], got[:4])


def test_smoothing_moves_the_choice_by_the_neighbours():
    # alone, position 1 prefers exit 1 (LL -1 vs -1.1); its neighbours prefer exit 3 by far
    S = np.array([[-3.0, -3.0, -0.5], [-1.0, -2.0, -1.1], [-3.0, -3.0, -0.5]], dtype=np.float32)
    table = hax.named(S, (P3, E3))
    assert H.oracle_exit(table, E3, P3, lam=0.0, sigma=NO_SMOOTHING).array[1] == 0
    smoothed = smoothed_reference(S, np.ones(3), 1.0)
    assert smoothed[1].argmax() == 2
    np.testing.assert_array_equal(H.oracle_exit(table, E3, P3, lam=0.0, sigma=1.0).array, smoothed.argmax(-1))


def test_oracle_tables_from_exit_logits():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(Pos.size, Exit.size, Vocab.size)).astype(np.float32)
    gold = rng.integers(0, Vocab.size, size=Pos.size)
    logits[0, :, gold[0]] = [-5.0, 5.0, 5.0, 5.0]  # wrong at exit 1, right from exit 2 on
    named, targets = hax.named(logits, (Pos, Exit, Vocab)), hax.named(gold, Pos)
    ll = H.gold_log_likelihood(named, Vocab, targets).rearrange((Pos, Exit)).array
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    reference = np.take_along_axis(logits, gold[:, None, None].repeat(Exit.size, 1), -1)[..., 0] - lse
    np.testing.assert_allclose(ll, reference, rtol=4 * EPS32, atol=8 * EPS32)
    correct = H.gold_correct(named, Vocab, targets).rearrange((Pos, Exit)).array
    np.testing.assert_array_equal(correct, (logits.argmax(-1) == gold[:, None]).astype(np.float32))
    np.testing.assert_array_equal(correct[0], [0, 1, 1, 1])
    # the correctness oracle without smoothing: the earliest correct exit (ties), lambda > 0 or not
    table = H.gold_correct(named, Vocab, targets)
    for lam in (0.0, 0.3):
        assert H.oracle_exit(table, Exit, Pos, lam=lam, sigma=NO_SMOOTHING).array[0] == 1


def test_halting_loss_is_weighted_cross_entropy_to_the_oracle():
    rng = np.random.default_rng(4)
    log_q = np.log(rng.dirichlet(np.ones(Exit.size), size=(Batch.size, Pos.size))).astype(np.float32)
    target = rng.integers(0, Exit.size, size=(Batch.size, Pos.size))
    m = rng.integers(0, 2, size=(Batch.size, Pos.size)).astype(np.float32)
    m[0, 0] = 1.0
    got = H.halting_loss(
        hax.named(log_q, (Batch, Pos, Exit)),
        hax.named(target, (Batch, Pos)),
        Exit,
        alpha=0.7,
        weight=hax.named(m, (Batch, Pos)),
    )
    num = sum(-m[b, t] * float(log_q[b, t, target[b, t]]) for b in range(Batch.size) for t in range(Pos.size))
    np.testing.assert_allclose(float(got.array), 0.7 * num / m.sum(), rtol=8 * EPS32)
