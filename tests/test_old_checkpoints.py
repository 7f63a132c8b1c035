"""Checkpoints written by the old stack (levanter 1.2.dev1644 / jax 0.7.2) load on marin-levanter.

tests/fixtures/levanter_1_2 holds `step-1` of a tiny DiffEqFormer run trained by the old version
and the logits that version computed from its model (README.md there). Here the new stack reads it:

* the model, through qkvflow's own loading path (`qkvflow.runs.model.load_model`, as `qkvflow export`,
  `analyze` and the benchmarks read checkpoints), computes the same logits (the old version stored one
  hypernetwork per weight; loading stacks them, `qkvflow.models.layout`);
* the whole trainer state (model, Adam state, step) restores with Levanter's `load_checkpoint` into
  the shapes of a fresh `TrainerState` of that config and optimizer;
* a config that does not describe the checkpoint still gets one line naming it.
"""

import dataclasses
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import pytest
from haliax import Axis

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "levanter_1_2"
STEP = FIXTURE / "step-1"
VOCAB = 300


def _model_config(**overrides):
    from qkvflow.integrate.config import OdeConfig
    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config

    fields = dict(max_seq_len=32, hidden_dim=16, num_heads=2, time_embed_dim=4, num_frequencies=4)
    return DiffEqFormerGpt2Config(ode=OdeConfig(num_steps=2), **(fields | overrides))


def _train_config(model=None):
    """The fixture run's config as far as loading needs it: its model section and its tokenizer."""
    from levanter.data.text import LmDataConfig

    from qkvflow.runs.config import TrainConfig

    data = LmDataConfig(tokenizer=str(FIXTURE / "tokenizer"))
    return TrainConfig(data=data, corpus=None, model=model or _model_config())


@pytest.fixture(scope="module")
def loaded():
    from qkvflow.runs.model import load_model

    return load_model(_train_config(), str(STEP))


@pytest.fixture(scope="module")
def expected():
    with np.load(FIXTURE / "expected.npz") as data:
        return {k: data[k] for k in data.files}


def _logits(model, ids) -> np.ndarray:
    return np.asarray(model(hax.named(jnp.asarray(ids), model.Pos)).rearrange(("position", "vocab")).array)


def _roundoff_scale(model, ids) -> np.ndarray:
    """S[p, v] = sum_e |h[p, e]| |W[e, v]|: the scale of float32 round-off in logit (p, v) = h[p] . W[:, v]."""
    h = model.activations(hax.named(jnp.asarray(ids), model.Pos)).rearrange(("position", "embed")).array
    head = model.get_lm_head().rearrange(("embed", "vocab")).array
    return np.abs(np.asarray(h, np.float64)) @ np.abs(np.asarray(head, np.float64))


def test_the_old_model_computes_the_old_logits(loaded, expected):
    model, tokenizer = loaded
    assert len(tokenizer) == VOCAB and model.Vocab.size == VOCAB and model.Pos.size == 32
    assert hasattr(tokenizer, "save_pretrained")  # the Hugging Face tokenizer, as exports need it
    ids = expected["input_ids"]
    ours = _logits(model, ids)
    # Tolerance: each logit is a 16-term dot product h . W[:, v] of the normed state with the head, whose
    # float32 round-off is bounded by n u S = 8 eps S (Higham, Accuracy and Stability, 3.1; n = hidden 16,
    # u = eps / 2); h itself carries a few ulps from the two Euler steps, attention and LayerNorm, which
    # XLA may now fuse or order differently. hidden * eps * S covers both (measured: 2.8 eps S at most).
    scale = _roundoff_scale(model, ids)
    tolerance = model.config.hidden_dim * np.finfo(np.float32).eps * scale
    assert np.all(np.abs(ours - expected["logits"]) <= tolerance), np.max(np.abs(ours - expected["logits"]) / scale)
    # The comparison can fail: the same weights with one Euler step fewer, or another norm epsilon,
    # compute logits far outside it.
    for changes in (dict(ode=dataclasses.replace(model.config.ode, num_steps=1)), dict(layer_norm_epsilon=1e-6)):
        other = dataclasses.replace(model, _config=dataclasses.replace(model.config, **changes))
        assert np.max(np.abs(_logits(other, ids) - expected["logits"]) - tolerance) > 0, changes


def test_a_run_folder_loads_its_newest_step(loaded, expected):
    from qkvflow.runs.model import load_model

    model, _ = load_model(_train_config(), str(FIXTURE))  # the folder that holds step-1
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(loaded[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_whole_trainer_state_restores_into_a_fresh_states_shapes(loaded):
    import levanter.checkpoint
    from levanter.optim import AdamConfig
    from levanter.trainer_state import TrainerState

    config = _model_config()
    optimizer = AdamConfig(learning_rate=1e-2, warmup=0.0, weight_decay=0.1, beta2=0.95).build(2)

    def fresh():  # in the layout the old version wrote: one hypernetwork per weight
        from qkvflow.models.layout import per_weight_model

        model = per_weight_model(config.build(Axis("vocab", VOCAB), key=jrandom.PRNGKey(0)))
        return TrainerState.init(optimizer, model, key=jrandom.PRNGKey(1))

    shape = eqx.filter_eval_shape(fresh)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with jax.set_mesh(mesh):
        state = levanter.checkpoint.load_checkpoint(shape, str(STEP), mesh=mesh)

    # step-N holds the state after N + 1 optimizer updates (Levanter numbers a step by the one just taken)
    assert int(state.step) == 2
    leaves, shapes = jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(shape)
    assert [(x.shape, x.dtype) for x in leaves] == [(s.shape, s.dtype) for s in shapes]
    from qkvflow.models.layout import stacked_model

    stacked = stacked_model(state.model)
    for a, b in zip(jax.tree_util.tree_leaves(stacked), jax.tree_util.tree_leaves(loaded[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Adam's moments: one per parameter, restored (not left at a fresh state's zeros), counted twice
    adam = [
        s for s in jax.tree_util.tree_leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")
    ]
    assert len(adam) == 1 and int(adam[0].count) == 2
    params = jax.tree_util.tree_leaves(eqx.filter(state.model, eqx.is_inexact_array))
    for moment in (adam[0].mu, adam[0].nu):
        values = jax.tree_util.tree_leaves(moment)
        assert [v.shape for v in values] == [p.shape for p in params]
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in values)
        assert sum(float(jnp.sum(jnp.abs(v))) for v in values) > 0
    assert all(float(jnp.min(v)) >= 0 for v in jax.tree_util.tree_leaves(adam[0].nu))  # second moments


@pytest.mark.parametrize(
    "model, vocab, says",
    [
        (dict(hidden_dim=32), None, "does not hold a DiffEqFormerGpt2Config model with vocabulary 300"),
        (dict(), 301, "does not hold a DiffEqFormerGpt2Config model with vocabulary 301"),
        ("llama", None, "does not hold a DiffEqFormerLlamaConfig model as the config describes: it lacks 16"),
    ],
)
def test_a_config_that_does_not_describe_it_gets_one_line(model, vocab, says):
    from qkvflow.errors import UserError
    from qkvflow.models.diffeqformer import DiffEqFormerLlamaConfig
    from qkvflow.runs.model import load_model

    if model == "llama":
        fields = dict(max_seq_len=32, hidden_dim=16, num_heads=2, time_embed_dim=4, num_frequencies=4)
        config = DiffEqFormerLlamaConfig(ode=_model_config().ode, **fields)
    else:
        config = _model_config(**model)
    with pytest.raises(UserError) as error:
        load_model(_train_config(config), str(STEP), vocab_size=vocab)
    message = str(error.value)
    assert says in message and repr(str(STEP)) in message and "\n" not in message


def test_damage_to_an_old_checkpoint_is_named_in_one_line(tmp_path):
    """The one-line errors hold for the old layout (a folder per array) too: a cut chunk file names its
    array (qkvflow's loading path), and a checkpoint without optimizer state says so when the whole
    trainer state is restored (`restore_error`, as `qkvflow train` reports a failed resume)."""
    import shutil

    import levanter.checkpoint
    from levanter.optim import AdamConfig
    from levanter.trainer_state import TrainerState

    from qkvflow.errors import UserError
    from qkvflow.runs.checkpoints import restore_error
    from qkvflow.runs.model import load_model

    cut = tmp_path / "cut" / "step-1"
    shutil.copytree(STEP, cut)
    chunk = cut / "model" / "token_embeddings" / "weight" / "0.0"
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    with pytest.raises(UserError) as error:
        load_model(_train_config(), str(cut))
    message = str(error.value)
    assert (
        message.startswith(
            f"checkpoint {str(cut)!r}: array model.token_embeddings.weight cannot be read, its chunk "
            "file '0.0' is damaged ("
        )
        and "\n" not in message
        and len(message) < 400
    ), message

    no_optimizer = tmp_path / "no_optimizer" / "step-1"
    shutil.copytree(STEP, no_optimizer)
    shutil.rmtree(no_optimizer / "opt_state")
    optimizer = AdamConfig(learning_rate=1e-2, warmup=0.0, weight_decay=0.1, beta2=0.95).build(2)
    from qkvflow.models.layout import per_weight_shape

    # the old version's layout (one hypernetwork per weight), so that only the optimizer state is missing
    model = per_weight_shape(_model_config().build, Axis("vocab", VOCAB), key=jrandom.PRNGKey(0))
    shape = eqx.filter_eval_shape(lambda m: TrainerState.init(optimizer, m, key=jrandom.PRNGKey(1)), model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with jax.set_mesh(mesh), pytest.raises(FileNotFoundError) as missing:
        levanter.checkpoint.load_checkpoint(shape, str(no_optimizer), mesh=mesh)
    message = str(restore_error(str(no_optimizer), missing.value))
    assert message.startswith(f"checkpoint {str(no_optimizer)!r} lacks ") and "arrays that this run restores" in message
    assert (
        "(no opt_state at all): opt_state." in message and "more; set trainer.allow_partial_checkpoint=true" in message
    )
    assert "\n" not in message and message.count("opt_state.") <= 3, message


def test_a_run_of_the_old_version_is_not_resumed_but_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Its model loads (above), but its optimizer state is Levanter 1.2's: `qkvflow train` with that run's
    id stops before any work, naming both versions, and leaves the checkpoint as it was."""
    import shutil

    import qkvflow.training.loop
    import qkvflow.training.session
    from qkvflow import cli
    from tests.train_utils import initialize_without_writes

    run = tmp_path / "checkpoints" / "fixture"
    shutil.copytree(STEP, run / "step-1")
    (tmp_path / "train.jsonl").write_text('{"text": "a document"}\n')
    before = sorted((p.relative_to(run), p.stat().st_size) for p in run.rglob("*") if p.is_file())

    def tripwire(*args, **kwargs):
        raise AssertionError("an old run reached the trainer")

    monkeypatch.setattr(qkvflow.training.session, "_initialize", initialize_without_writes)
    monkeypatch.setattr(qkvflow.training.session, "build_caches", tripwire)  # what follows the resume check
    monkeypatch.chdir(tmp_path)
    rc = cli.main(
        [
            "train",
            "--config_path",
            str(FIXTURE.parent.parent / "configs" / "tiny_train.yaml"),
            "--corpus",
            "null",
            "--data.tokenizer",
            str(FIXTURE / "tokenizer"),
            "--data.components.c.source.train_urls",
            f"[{tmp_path / 'train.jsonl'}]",
            "--model.hidden_dim",
            "16",
            "--model.time_embed_dim",
            "4",
            "--model.num_frequencies",
            "4",
            "--trainer.id",
            "fixture",
            "--trainer.checkpointer.base_path",
            str(tmp_path / "checkpoints"),
            "--trainer.tracker",
            f"{{type: jsonl, path: {tmp_path / 'runs'}}}",
            "--trainer.log_dir",
            str(tmp_path / "logs"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert "written by qkvflow 0.1 (levanter 1.2.dev1644" in err and "cannot resume" in err, err
    assert str(run / "step-1") in err
    assert (
        sorted(
            (p.relative_to(run), p.stat().st_size) for p in run.rglob("*") if p.is_file() and p.name != ".qkvflow.lock"
        )
        == before
    )


def test_a_checkpoint_of_the_per_weight_layout_loads_stacked_and_refuses_to_resume(tmp_path):
    """A checkpoint of the current format (OCDBT) whose DiffEqFormer stores one hypernetwork per weight,
    as qkvflow 0.2.0 wrote before stacking: `load_model` (eval, export, analyze, finetune) reads it and
    stacks it, giving the model that was saved, bit for bit; resuming a run from it is refused in one line
    naming the layout and the version."""
    import levanter.checkpoint

    from qkvflow.errors import UserError
    from qkvflow.models.generator import HyperGenerator
    from qkvflow.models.layout import per_weight_model
    from qkvflow.models.per_weight import PerWeightGenerator
    from qkvflow.runs.model import load_model
    from qkvflow.training.preflight import check_resume

    config = _model_config(time_embed_norm=True)
    model = config.build(Axis("vocab", VOCAB), key=jrandom.PRNGKey(7))
    # trained-like: every array moved off its initial value, so that a swapped row would show
    leaves, treedef = jax.tree_util.tree_flatten(model)
    keys = jrandom.split(jrandom.PRNGKey(8), len(leaves))
    leaves = [x + 0.01 * jrandom.normal(k, x.shape) if eqx.is_inexact_array(x) else x for x, k in zip(leaves, keys)]
    model = jax.tree_util.tree_unflatten(treedef, leaves)
    old = per_weight_model(model)
    assert isinstance(old.generator, PerWeightGenerator) and "q" in old.generator.weights
    step = tmp_path / "run" / "step-3"
    levanter.checkpoint.save_checkpoint({"model": old}, step=3, checkpoint_path=str(step), is_temporary=False)

    loaded_model, _ = load_model(_train_config(config), str(step))
    assert isinstance(loaded_model.generator, HyperGenerator)
    for a, b in zip(jax.tree_util.tree_leaves(loaded_model), jax.tree_util.tree_leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = (np.arange(32) * 7) % VOCAB
    np.testing.assert_array_equal(_logits(loaded_model, ids), _logits(model, ids))

    train = dataclasses.replace(
        _train_config(config),
        trainer=dataclasses.replace(_train_config(config).trainer, load_checkpoint_path=str(step), id="resumed"),
    )
    with pytest.raises(UserError) as error:
        check_resume(train, Axis("vocab", VOCAB))
    message = str(error.value)
    assert "written by qkvflow 0.2.0 with one hypernetwork per weight" in message and "cannot resume" in message
    assert str(step) in message and "\n" not in message
