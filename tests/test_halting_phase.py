"""The halting family (`halting_gpt2`) and its training phase (`qkvflow.training.halting_phase`).

References: numpy from the paper's equations (`tests.models.test_halting` has the per-function ones);
the exits model's own copy-up scan (`exit_states(exits=...)`) for the evaluation.
"""

import dataclasses
import math
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import levanter.checkpoint
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmExample
from levanter.optim import AdamConfig
from levanter.trainer_state import TrainerState

from qkvflow.errors import UserError
from qkvflow.models.related.adaptive import AdaptiveGpt2Config
from qkvflow.models.related.halting import HaltingConfig, HaltingGpt2Config, HaltingLMHeadModel
from qkvflow.runs.config import TrainConfig
from qkvflow.training import halting_phase
from tests.analysis.builders import filled
from tests.helpers import Batch, Vocab
from tests.models.test_halting import geometric_q_reference, smoothed_reference

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=3, initializer_range=0.2)


def config_of(kind="geometric", **halting):
    return HaltingGpt2Config(**SHAPE, halting=HaltingConfig(kind=kind, **halting))


@pytest.fixture(scope="module")
def tokens():
    return hax.random.randint(jax.random.PRNGKey(1), (Batch, hax.Axis("position", 12)), 0, Vocab.size)


def example(tokens):
    return LmExample(tokens=tokens, loss_weight=hax.ones(tokens.axes), attn_mask=AttentionMask.causal())


def head_params(model):
    w = np.asarray(model.halting_head.proj.weight.array, np.float64).reshape(-1, SHAPE["hidden_dim"])
    return w, np.asarray(model.halting_head.proj.bias.array, np.float64).reshape(-1)


def layer_norm(model, n, x):
    """norm_n(x) (tied exits: the final LayerNorm), by its equation."""
    norm = model.exit_classifier(n)[0]
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + norm.eps) * np.asarray(norm.weight.array) + np.asarray(norm.bias.array)


@pytest.mark.parametrize("oracle", ["likelihood", "correctness"])
def test_training_loss_is_the_cross_entropy_to_the_oracle(tokens, oracle):
    config = config_of(oracle=oracle, lam=0.05, sigma=1.0, alpha=0.5)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    got = float(model.compute_next_token_loss(example(tokens), key=jax.random.PRNGKey(2)).array)

    L = config.Layers
    states = np.asarray(model.exit_states(tokens).rearrange((Batch, "position", L, "embed")).array, np.float64)
    logits = np.asarray(model.exit_logits(tokens).rearrange((Batch, "position", L, "vocab")).array, np.float64)
    ids = np.asarray(tokens.array)
    T, N = ids.shape[1], L.size
    m = np.ones(T)
    m[-1] = 0.0  # no next token
    w, b = head_params(model)
    total = 0.0
    for i in range(Batch.size):
        gold = np.roll(ids[i], -1)
        log_p = logits[i] - np.log(np.exp(logits[i]).sum(-1, keepdims=True))
        ll = np.take_along_axis(log_p, gold[:, None, None].repeat(N, 1), -1)[..., 0]
        score = ll if oracle == "likelihood" else (logits[i].argmax(-1) == gold[:, None]).astype(float)
        target = (smoothed_reference(score, m, 1.0) - 0.05 * np.arange(1, N + 1)).argmax(-1)
        h = np.stack([layer_norm(model, n + 1, states[i, :, n]) for n in range(N)], 1)
        q = geometric_q_reference(1.0 / (1.0 + np.exp(-(h @ w[0] + b[0]))))
        total += sum(-math.log(q[t, target[t]]) for t in range(T - 1))
    reference = 0.5 * total / (Batch.size * (T - 1))
    np.testing.assert_allclose(got, reference, rtol=2e-5)  # float32 sums over d = 32 and V = 61


def test_the_likelihood_oracle_scores_the_next_token(tokens):
    """n* of the likelihood oracle, by its equation with lambda = 0 and no smoothing: per position t, the
    exit n whose logits give the gold token y_t = x_{t+1} the highest log-likelihood. The target must be
    the next token: scoring x_t itself picks other exits at most positions (checked on the reference)."""
    config = config_of(oracle="likelihood", lam=0.0, sigma=1e-3)  # kappa(1) = exp(-1000) = 0: no smoothing
    model = filled(config, Vocab, seed=5, std=0.2)  # random weights, filled without compiling an initialiser
    L, T = config.Layers, tokens.axis_size("position")
    weight = hax.named(jnp.asarray(np.arange(T) < T - 1, jnp.float32), tokens.resolve_axis("position"))
    oracle_and_logits = eqx.filter_jit(lambda m, x, w: (m.oracle(x, m.exit_states(x), w), m.exit_logits(x)))
    got, logits = oracle_and_logits(model, tokens, weight)  # one compiled program: seconds, not a minute
    got = np.asarray(got.rearrange((Batch, "position")).array)
    logits = np.asarray(logits.rearrange((Batch, "position", L, "vocab")).array, np.float64)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.asarray(tokens.array)

    def best_exit(gold):  # [batch, position] -> argmax_n LL(n), and its margin over the runner-up
        ll = np.take_along_axis(log_p, gold[:, :, None, None].repeat(L.size, 2), -1)[..., 0]
        ordered = np.sort(ll, -1)
        return ll.argmax(-1)[:, : T - 1], (ordered[..., -1] - ordered[..., -2])[:, : T - 1]

    want, margin = best_exit(np.roll(ids, -1, axis=1))
    assert margin.min() > 1e-4  # no near-ties that float32 could flip
    np.testing.assert_array_equal(got[:, : T - 1], want)
    unshifted, _ = best_exit(ids)
    assert (unshifted != want).mean() > 0.3


def test_geometric_evaluation_equals_copy_up_at_its_exits(tokens):
    config = config_of(tau=0.5)
    model = config.build(Vocab, key=jax.random.PRNGKey(3))
    # a head whose decisions spread over the exits: tests near chi = 0.5
    model = eqx.tree_at(lambda m: m.halting_head.proj.weight, model, replace_fn=lambda x: x * 40.0)
    out = model.halting_exits(tokens)
    exits = np.asarray(out.exits.array)
    assert len(np.unique(exits)) >= 2, exits

    L = config.Layers
    copied = model.exit_states(tokens, exits=out.exits)  # the exits model's copy-up scan
    x = np.asarray(copied.rearrange((Batch, "position", L, "embed")).array, np.float64)
    w, b = head_params(model)
    for i in range(Batch.size):
        for t in range(tokens.axis_size("position")):
            chi = [1.0 / (1.0 + math.exp(-(layer_norm(model, n + 1, x[i, t, n]) @ w[0] + b[0]))) for n in range(3)]
            first = next((n + 1 for n in range(2) if chi[n] > 0.5), 3)
            assert exits[i, t] == first, (i, t, chi)
    at_exit = hax.stack(L, [model.logits_at(n, copied[L, n - 1]) for n in (1, 2, 3)])
    chosen = at_exit[L, hax.named(jnp.asarray(exits - 1), out.exits.axes)]
    np.testing.assert_allclose(
        np.asarray(out.logits.rearrange(chosen.axes).array), np.asarray(chosen.array), rtol=1e-5, atol=1e-5
    )
    # the evaluation loss (no key): the next-token loss of those logits
    logits = np.asarray(out.logits.rearrange((Batch, "position", "vocab")).array, np.float64)
    ids = np.asarray(tokens.array)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = [-log_p[i, t, ids[i, t + 1]] for i in range(Batch.size) for t in range(ids.shape[1] - 1)]
    got = float(model.compute_next_token_loss(example(tokens)).array)
    np.testing.assert_allclose(got, np.mean(nll), rtol=2e-5)


def test_multinomial_evaluation_exits_at_the_argmax_from_h1(tokens):
    config = config_of("multinomial")
    model = config.build(Vocab, key=jax.random.PRNGKey(4))
    model = eqx.tree_at(lambda m: m.halting_head.proj.weight, model, replace_fn=lambda x: x * 40.0)
    out = model.halting_exits(tokens)
    x1 = np.asarray(model.exit_states(tokens)[config.Layers, 0].rearrange((Batch, "position", "embed")).array)
    w, b = head_params(model)
    np.testing.assert_array_equal(np.asarray(out.exits.array), (layer_norm(model, 1, x1) @ w.T + b).argmax(-1) + 1)


def test_a_halting_step_changes_only_the_head(tokens):
    model = config_of().build(Vocab, key=jax.random.PRNGKey(5))
    is_trainable = halting_phase.trainable_filter(model)
    optimizer = AdamConfig(learning_rate=1e-2, weight_decay=0.1, warmup=0.0).build(10)
    state = TrainerState.init(optimizer, model, key=jax.random.PRNGKey(0), is_trainable=is_trainable)
    trainable, frozen = eqx.partition(state.model, is_trainable)

    def loss(trainable):
        return eqx.combine(trainable, frozen).compute_next_token_loss(example(tokens), key=jax.random.PRNGKey(6)).array

    grads = eqx.filter_jit(eqx.filter_grad(loss))(trainable)
    new = state.take_step(grads, key=jax.random.PRNGKey(7))[0].model
    before, after = dataclasses.replace(model, halting_head=None), dataclasses.replace(new, halting_head=None)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree_util.tree_leaves(model.halting_head), jax.tree_util.tree_leaves(new.halting_head)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() > 0


def test_prepare_loads_the_aligned_trunk_and_freezes_it(tmp_path):
    aligned = AdaptiveGpt2Config(**SHAPE).build(Vocab, key=jax.random.PRNGKey(8))
    levanter.checkpoint.save_checkpoint({"model": aligned}, 0, str(tmp_path / "step-0"), is_temporary=False)
    config = TrainConfig(model=config_of())
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, initialize_from=str(tmp_path)))
    prepared, model, is_trainable = halting_phase.prepare(config, Vocab, jax.random.PRNGKey(9))
    assert prepared.trainer.initialize_from is None and isinstance(model, HaltingLMHeadModel)
    assert model.config == config.model
    for a, b in zip(
        jax.tree_util.tree_leaves(aligned), jax.tree_util.tree_leaves(dataclasses.replace(model, halting_head=None))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    flags = jax.tree_util.tree_leaves(is_trainable)
    assert sum(flags) == len(jax.tree_util.tree_leaves(model.halting_head)) == 2 and len(flags) > 2
    assert halting_phase.prepare(TrainConfig(model=config_of("none")), Vocab, None)[1] is None


def test_prepare_without_the_aligned_checkpoint_names_the_key(tmp_path):
    with pytest.raises(UserError, match="trainer.initialize_from="):
        halting_phase.prepare(TrainConfig(model=config_of()), Vocab, jax.random.PRNGKey(0))
    config = TrainConfig(model=config_of())
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, initialize_from=str(tmp_path)))
    with pytest.raises(UserError, match="trainer.initialize_from="):
        halting_phase.prepare(config, Vocab, jax.random.PRNGKey(0))


def test_the_benchmark_writes_a_halting_phase_config_of_the_aligned_run(tmp_path):
    """benchmarks/halting.py: the aligned run's config with the halting family, its keys, the aligned
    checkpoint as trainer.initialize_from and every output in the study's folder (no training here)."""
    import importlib.util

    import yaml

    from tests.helpers import parse_config

    spec = importlib.util.spec_from_file_location("halting_bench", ROOT / "benchmarks" / "halting.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    aligned = {
        "corpus": {"name": "tinyshakespeare", "root": "/elsewhere"},
        "trainer": {"id": "aligned", "num_train_steps": 300, "checkpointer": {"base_path": "/elsewhere/ckpt"}},
        "optimizer": {"learning_rate": 2e-3},
        "model": {"type": "adaptive_gpt2", **{k: v for k, v in SHAPE.items() if k != "initializer_range"}},
    }
    (tmp_path / "aligned.yaml").write_text(yaml.safe_dump(aligned))
    argv = ["--aligned_config", str(tmp_path / "aligned.yaml"), "--aligned_checkpoint", str(tmp_path / "ckpt")]
    args = bench.parser().parse_args([*argv, "--corpus_root", str(tmp_path / "corpora"), "--steps", "7"])
    run_id, path = bench.run_config(args, "likelihood", 0.3, tmp_path / "study")
    config = parse_config(path, TrainConfig)
    assert run_id == "geometric-likelihood-lam0.3" and config.trainer.id == run_id
    expected = config_of("geometric", oracle="likelihood", lam=0.3, sigma=1.0, tau=0.5)
    assert config.model == dataclasses.replace(expected, initializer_range=0.02)
    assert config.trainer.initialize_from == str(tmp_path / "ckpt") and config.trainer.num_train_steps == 7
    assert config.trainer.checkpointer.base_path == str(tmp_path / "study" / "checkpoints")
    assert config.corpus.root == str(tmp_path / "corpora") and config.optimizer.learning_rate == 5e-3
