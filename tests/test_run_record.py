"""A run's identity (qkvflow.runs.run_record): a resumed id whose model, data, optimizer or batch
differs from what its run recorded is refused in one line; the keys that may change are pinned; older
runs are compared with the first hyperparameters their metrics.jsonl holds. In-process, on fake run
folders (a `step-N` folder with the metadata Levanter writes last); the end-to-end checks are in
tests/test_train.py."""

import json

import pytest

from qkvflow.errors import UserError
from qkvflow.runs import run_record
from tests.helpers import parse_config
from tests.train_utils import TINY

# the keys docs/checkpoints.md says a resume may change (and every key under them)
PINNED = (
    "trainer.num_train_steps", "stop_after", "epochs",
    "trainer.steps_per_eval", "eval_before", "log_every", "verbose", "loss_curve", "trainer.tracker", "trainer.wandb",
    "trainer.log_dir", "trainer.watch", "trainer.profiler", "trainer.log_jaxprs", "trainer.log_xla_hlo",
    "trainer.checkpointer", "trainer.load_checkpoint", "trainer.load_checkpoint_path", "trainer.initialize_from",
    "trainer.allow_partial_checkpoint",
    "trainer.mesh", "trainer.use_explicit_mesh_axes", "trainer.per_device_parallelism",
    "trainer.per_device_eval_parallelism", "trainer.distributed", "trainer.jax_config",
    "trainer.jax_compilation_cache_dir", "trainer.require_accelerator", "trainer.shutdown_at_exit",
    "model.ode.checkpoints", "model.gradient_checkpointing",
    "loss_vocab_block", "model.cross_entropy_block_size",
    "nonfinite", "trainer.crash_on_nan", "trainer.crash_on_inf",
    "hypernetwork_mu_dtype",
    "corpus.root", "data.cache_dir", "data.components.*.cache_dir", "data.cache_options", "data.auto_build_caches",
    "export", "sweep",
)  # fmt: skip


def _config(tmp_path, *args):
    return parse_config(
        TINY,
        args=[
            "--trainer.checkpointer.base_path", str(tmp_path / "checkpoints"),
            "--trainer.tracker", f"{{type: jsonl, path: {tmp_path / 'runs'}}}",
            "--trainer.log_dir", str(tmp_path / "logs"),
            *args,
        ],
    )  # fmt: skip


def _checkpoint(tmp_path, step: int, run_id: str = "tiny"):
    """A complete checkpoint of `step` as far as resuming goes: Levanter writes metadata.json last."""
    folder = tmp_path / "checkpoints" / run_id / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "manifest.ocdbt").write_bytes(b"\0" * 32)
    (folder / "metadata.json").write_text(json.dumps({"step": step, "timestamp": "2026-11-29T00:00:00"}))


@pytest.fixture
def started(tmp_path):
    """A run of the tiny config that recorded its config at its first start and has a checkpoint of step 4."""
    pending = run_record.check(_config(tmp_path))
    assert pending is not None  # a new run: recorded at its start
    run_record.write(pending)
    _checkpoint(tmp_path, 4)
    return tmp_path


def test_the_keys_that_may_change_on_resume_are_pinned_and_documented():
    assert run_record.MAY_CHANGE == PINNED
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text()
    section = docs.split("## What a resume may change", 1)[1].split("\n## ", 1)[0]
    missing = [key for key in PINNED if f"`{key}`" not in section]
    assert not missing, missing


def test_the_record_is_the_config_as_parsed_and_is_written_atomically(started):
    folder = started / "checkpoints" / "tiny"
    assert sorted(p.name for p in folder.iterdir()) == ["run_config.json", "step-4"]  # no temporary file left
    record = json.loads((folder / "run_config.json").read_text())["config"]
    assert record["model"]["type"] == "diffeqformer_gpt2" and record["model"]["ode"]["num_steps"] == 2
    assert record["trainer"]["train_batch_size"] == 8 and record["optimizer"]["learning_rate"] == 0.01
    assert run_record.flatten(record) == run_record.snapshot(_config(started))


def test_a_start_writes_its_record_only_once_its_state_is_restored(tmp_path):
    """`session.start` holds the record; the run loop writes it after the restore, so a start refused there
    (tests/test_bad_input.py::test_end_to_end_in_a_subprocess) leaves the checkpoint folder as it was."""
    config = _config(tmp_path)
    folder = run_record.run_folder(config.trainer)
    run_record.hold(folder, run_record.check(config))
    assert not (tmp_path / "checkpoints" / "tiny" / "run_config.json").exists()
    run_record.write_held(folder)
    assert (tmp_path / "checkpoints" / "tiny" / "run_config.json").is_file()
    (tmp_path / "checkpoints" / "tiny" / "run_config.json").unlink()
    run_record.write_held(folder)  # written once
    run_record.hold(folder, run_record.check(config))
    run_record.hold(folder, None)  # a later start of the folder in the same process, with nothing to record
    run_record.write_held(folder)
    assert not (tmp_path / "checkpoints" / "tiny" / "run_config.json").exists()


REFUSED = {
    "model": (["--model.ode.num_steps", "4"], "model.ode.num_steps 2 -> 4"),
    "batch": (["--trainer.train_batch_size", "16"], "trainer.train_batch_size 8 -> 16"),
    "optimizer": (["--optimizer.learning_rate", "0.001"], "optimizer.learning_rate 0.01 -> 0.001"),
    "seed": (["--trainer.seed", "1"], "trainer.seed 0 -> 1"),
    "data seed": (["--data_seed", "3"], "data_seed null -> 3"),
    "data": (["--data.shuffle", "true"], "data.shuffle false -> true"),
    "tokenizer": (["--corpus.vocab_size", "600"], "corpus.vocab_size null -> 600"),
    "precision": (["--trainer.mp", "p=f32,c=bf16"], "trainer.mp compute=float32,params=float32,output=float32 -> "),
    "eval set": (["--trainer.max_eval_batches", "4"], "trainer.max_eval_batches 1 -> 4"),
    "z-loss": (["--z_loss_weight", "0.001"], "z_loss_weight 0.0 -> 0.001"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_resume_that_changes_the_run_is_refused_in_one_line(started, case):
    args, change = REFUSED[case]
    with pytest.raises(UserError) as refused:
        run_record.check(_config(started, *args))
    message = str(refused.value)
    assert "\n" not in message and change in message, message
    assert message.startswith("run 'tiny' was started with another config (recorded in ")
    assert "--trainer.id NEW" in message


def test_a_section_replaced_by_null_or_by_another_shape_is_refused(started):
    """Keys only one side has are not compared (a field added since), except where one side holds a whole
    section and the other a single value in its place: the corpus dropped for other data is another run."""
    url = ["--corpus", "null", "--data.components", "{web: {source: {type: url, train_urls: [a.jsonl]}}}"]
    with pytest.raises(UserError) as refused:
        run_record.check(_config(started, *url))
    message = str(refused.value)
    assert "corpus {" in message and '"name": "pydoc"' in message and "-> null" in message, message
    assert "data.components {} -> {" in message, message


def test_another_model_type_is_refused(started):
    import dataclasses

    from levanter.models.gpt2 import Gpt2Config

    config = _config(started)
    gpt2 = dataclasses.replace(config, model=Gpt2Config(max_seq_len=32, hidden_dim=32, num_heads=2, num_layers=2))
    with pytest.raises(UserError, match="model.type diffeqformer_gpt2 -> gpt2, "):
        run_record.check(gpt2)


@pytest.mark.parametrize("text", ["[1, 2]", '{"model": {}}', "{not json"])
def test_a_record_that_is_not_one_is_refused_in_one_line(started, text):
    record = started / "checkpoints" / "tiny" / "run_config.json"
    record.write_text(text)
    with pytest.raises(UserError) as refused:
        run_record.check(_config(started))
    assert str(record) in str(refused.value) and "\n" not in str(refused.value)


def test_the_refusal_names_every_changed_key_up_to_four():
    changes = [(f"model.k{i}", i, i + 1) for i in range(6)]
    message = run_record.refusal("r", "x", changes)
    assert "model.k0 0 -> 1, model.k1 1 -> 2, model.k2 2 -> 3, model.k3 3 -> 4 and 2 more;" in message


ALLOWED = {
    "length": ["--trainer.num_train_steps", "20", "--stop_after", "10", "--epochs", "3"],
    "cadence": ["--trainer.steps_per_eval", "2", "--log_every", "5", "--verbose", "true", "--loss_curve", "null"],
    "trackers": ["--trainer.tracker", "[{type: jsonl, path: elsewhere}, {type: tensorboard}]"],
    "checkpoints": ["--trainer.checkpointer.save_interval", "2m", "--trainer.checkpointer.keep", "[{every: 2}]"],
    "devices": ["--trainer.mesh.axes", "{data: 2, replica: 1, model: 2}", "--trainer.per_device_parallelism", "2"],
    "rematerialisation": ["--model.ode.checkpoints", "2"],
    "vocabulary block": ["--loss_vocab_block", "64"],
    "non-finite policy": ["--nonfinite", "skip"],
    "locations": ["--corpus.root", "/elsewhere/corpora", "--data.cache_dir", "/elsewhere/cache"],
}


@pytest.mark.parametrize("case", list(ALLOWED))
def test_the_keys_that_may_change_pass(started, case):
    assert run_record.check(_config(started, *ALLOWED[case])) is None  # compared, and the record kept


def test_a_run_without_a_complete_checkpoint_starts_again_and_is_recorded_anew(tmp_path):
    run_record.write(run_record.check(_config(tmp_path)))
    (tmp_path / "checkpoints" / "tiny" / "step-3").mkdir()  # a write a kill interrupted: no metadata.json
    changed = _config(tmp_path, "--trainer.train_batch_size", "16")
    pending = run_record.check(changed)
    assert pending is not None and pending.config["trainer.train_batch_size"] == 16
    run_record.write(pending)
    record = json.loads((tmp_path / "checkpoints" / "tiny" / "run_config.json").read_text())
    assert record["config"]["trainer"]["train_batch_size"] == 16


def test_a_run_begun_before_the_record_is_compared_with_its_first_hyperparameters(tmp_path):
    """Levanter's tracker logged the config of each start to metrics.jsonl; the first one stands in for the
    record (written here by qkvflow's jsonl tracker from Levanter's own `hparams_to_dict`)."""
    from levanter.tracker.helpers import hparams_to_dict

    from qkvflow.runs.tracking import JsonlTracker

    no_corpus = ["--corpus", "null"]  # `data` as Levanter logged it, without building the corpus
    first, later = _config(tmp_path, *no_corpus), _config(tmp_path, *no_corpus, "--model.ode.num_steps", "8")
    tracker = JsonlTracker(str(tmp_path / "runs" / "tiny" / "metrics.jsonl"))
    tracker.log_hyperparameters(hparams_to_dict(first))
    tracker.log_hyperparameters(hparams_to_dict(later))  # a later start's: not what the run began with
    _checkpoint(tmp_path, 4)
    with pytest.raises(
        UserError, match=r"its first start's hyperparameters in .*metrics.jsonl\): model.ode.num_steps 2 -> 8"
    ):
        run_record.check(later)
    pending = run_record.check(_config(tmp_path, *no_corpus, "--trainer.steps_per_eval", "3"))
    assert pending is not None  # the same run: recorded from now on


def test_an_older_run_on_a_corpus_is_compared_with_data_as_levanter_logged_it(tmp_path, corpus_root):
    """Levanter logged the config after `data` was pointed at the corpus (session.with_corpus): the same
    run's config passes, and a changed one is refused."""
    from levanter.tracker.helpers import hparams_to_dict

    from qkvflow.runs.corpus import with_corpus
    from qkvflow.runs.tracking import JsonlTracker

    first = _config(tmp_path, "--corpus.root", str(corpus_root))
    JsonlTracker(str(tmp_path / "runs" / "tiny" / "metrics.jsonl")).log_hyperparameters(
        hparams_to_dict(with_corpus(first))
    )
    _checkpoint(tmp_path, 4)
    assert run_record.check(first, with_corpus) is not None  # the same run, recorded from now on
    with pytest.raises(UserError, match="trainer.train_batch_size 8 -> 4"):
        run_record.check(
            _config(tmp_path, "--corpus.root", str(corpus_root), "--trainer.train_batch_size", "4"), with_corpus
        )


def test_a_run_with_no_record_at_all_is_taken_as_it_is_and_recorded(tmp_path, capsys):
    """Nothing to compare with: the start goes on, and says so when it records its config (after the checks
    that may still refuse it, which print one line only)."""
    _checkpoint(tmp_path, 4)
    pending = run_record.check(_config(tmp_path, "--model.ode.num_steps", "8"))
    assert pending is not None and capsys.readouterr().err == ""
    run_record.write(pending)
    assert capsys.readouterr().err == (
        f"run 'tiny' had no record of the config it was started with (begun before qkvflow kept one): "
        f"this start's config is recorded in {tmp_path / 'checkpoints' / 'tiny' / 'run_config.json'}\n"
    )
    assert run_record.check(_config(tmp_path, "--model.ode.num_steps", "8")) is None  # recorded: compared now


def test_the_newest_checkpoint_is_found_without_levanter_logging_to_the_terminal(tmp_path, capfd):
    folder = tmp_path / "checkpoints" / "tiny"
    (folder / "step-3").mkdir(parents=True)  # a write a kill interrupted
    assert run_record.newest_step(str(folder)) is None
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 9)
    (folder / "step-11").mkdir()
    (folder / "step-11" / "metadata.json").write_text("{not json")  # the start-up names it (faults)
    assert run_record.newest_step(str(folder)) == 10
    assert run_record.newest_step(str(tmp_path / "none")) is None
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize(
    "newest,args,finished",
    [
        (8, [], 8),
        (4, ["--stop_after", "4"], 4),  # an invocation's target is stop_after when smaller
        (4, ["--stop_after", "5"], None),
        (8, ["--trainer.num_train_steps", "9"], None),
        (8, ["--stop_after", "9"], 8),
    ],
)
def test_a_run_at_its_target_has_nothing_to_train(tmp_path, newest, args, finished):
    for step in sorted({2, newest}):
        _checkpoint(tmp_path, step)
    config = _config(tmp_path, *args)
    assert run_record.finished(config) == finished
    # a run that loads another folder's checkpoint goes through the trainer, which finds out itself
    other = _config(tmp_path, *args, "--trainer.load_checkpoint_path", str(tmp_path / "checkpoints/tiny/step-2"))
    assert run_record.finished(other) is None


def test_a_finished_run_says_so_in_one_line_after_the_value_and_identity_checks(tmp_path, capsys):
    """`session.nothing_to_train`, what `qkvflow train` runs first: a bad value or a changed run is refused
    as it would be on an unfinished run; the same run prints one line and returns its summary."""
    from qkvflow.training import session

    run_record.write(run_record.check(_config(tmp_path)))
    _checkpoint(tmp_path, 8)
    capsys.readouterr()
    with pytest.raises(UserError, match="log_every=0 is invalid"):
        session.nothing_to_train(_config(tmp_path, "--log_every", "0"))
    with pytest.raises(UserError, match="model.ode.num_steps 2 -> 3"):
        session.nothing_to_train(_config(tmp_path, "--model.ode.num_steps", "3"))
    assert session.nothing_to_train(_config(tmp_path, "--trainer.num_train_steps", "9")) is None
    summary = session.nothing_to_train(_config(tmp_path, "--trainer.steps_per_eval", "2"))
    assert summary == {"run_id": "tiny", "steps": 8, "nothing_to_train": True}
    assert capsys.readouterr().out == "run tiny is already at step 8 (target 8): nothing to train\n"
