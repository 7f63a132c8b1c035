"""Bad input to `qkvflow train`, table-driven: each case ends with exit status 2 and one line
(`qkvflow train: error: ...`) naming the file or key and what was expected, no traceback, and no
checkpoint written or changed.

The cases run the real CLI entry point (`qkvflow.cli.main`) in this process, with the step that
would start JAX's distributed runtime replaced by a tripwire, so each case fails where a real run
would (config parsing, `qkvflow.training.preflight`) without paying for a JAX start-up. The checkpoint cases
let the run go on to the resume check, with the trainer itself replaced by a tripwire. Three cases at
the end run the whole command, one after another in one subprocess, to show the same outcome end to end.
"""

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.train_utils import TINY, cli_in_one_process, initialize_without_writes, train_args, train_env

ROOT = Path(__file__).resolve().parents[1]


class Tripwire(Exception):
    """Raised where a bad input should already have been refused."""


@pytest.fixture(scope="module")
def world(tmp_path_factory, corpus_root):
    """A working folder with a valid config, bad data files, and a checkpoint of run `tiny`."""
    import jax.random as jrandom
    import levanter.checkpoint
    from haliax import Axis

    from qkvflow.integrate.config import OdeConfig
    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config

    w = tmp_path_factory.mktemp("bad_input")
    base = Path(TINY).read_text()
    (w / "base.yaml").write_text(base)
    (w / "malformed.yaml").write_text("model: {type: [\n")
    (w / "latin1.yaml").write_bytes(base.encode() + b"\n# caf\xe9\n")
    (w / "list.yaml").write_text("- model\n- trainer\n")
    (w / "empty.yaml").write_text("")
    (w / "typo.yaml").write_text(base.replace("  hidden_dim: 32", "  hiden_dim: 32"))
    (w / "wrong_type.yaml").write_text(base.replace("num_train_steps: 8", "num_train_steps: many"))
    data = w / "data"
    data.mkdir()
    (data / "empty.jsonl").write_text("")
    (data / "blank.jsonl").write_text("\n  \n\n")
    (data / "plain.txt").write_text("Documented once as a format, but Levanter's URL data does not read it.\n")
    good = '{"text": "a valid record"}\n'
    (data / "bad_line_3.jsonl").write_text(good * 2 + '{"text": "unterminated\n' + good)
    (data / "no_text_line_2.jsonl").write_text(good + '{"content": "x"}\n')
    (data / "blank_line_2.jsonl").write_text(good + "\n" + good)
    (data / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    (data / "not_json.jsonl").write_text("just some words\n")
    (data / "no_text.jsonl").write_text('{"content": "the field is called text"}\n')
    (data / "folder").mkdir()
    (w / "broken_tokenizer").mkdir()
    (w / "broken_tokenizer" / "tokenizer.json").write_text("{")

    # a checkpoint of run `tiny`, written by Levanter's checkpointer for the config in base.yaml
    config = DiffEqFormerGpt2Config(
        max_seq_len=32, hidden_dim=32, num_heads=2, time_embed_dim=8, num_frequencies=16, ode=OdeConfig(num_steps=2)
    )
    model = config.build(Axis("vocab", 2048), key=jrandom.PRNGKey(0))
    levanter.checkpoint.save_checkpoint(
        {"model": model}, step=5, checkpoint_path=str(w / "checkpoints" / "tiny" / "step-5")
    )
    (w / "checkpoints" / "junk").mkdir()
    (w / "checkpoints" / "junk" / "file.bin").write_bytes(b"\0" * 10)
    return w


def _snapshot(folder: Path) -> dict:
    """Every path under `folder`, with size and modification time for files. Folders are listed
    without their times: the run lock and the write probes create and remove files in them."""
    return {str(p): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def _fill(text: str, world: Path, corpus_root: Path) -> str:
    return text.replace("{w}", str(world)).replace("{corpus}", str(corpus_root))


def _run_cli(world: Path, corpus_root: Path, args: list[str], capsys) -> tuple[int, str]:
    from qkvflow import cli

    argv = [
        "train",
        "--corpus.root",
        str(corpus_root),
        "--trainer.checkpointer.base_path",
        str(world / "checkpoints"),
        "--trainer.tracker",
        f"{{type: jsonl, path: {world / 'runs'}}}",
        "--trainer.log_dir",
        str(world / "logs"),
        *[_fill(a, world, corpus_root) for a in args],
    ]
    if "--config_path" not in args:
        argv[1:1] = ["--config_path", str(world / "base.yaml")]
    capsys.readouterr()
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


# No corpus: one url component `c` (qkvflow.cli turns `--data.components.c.KEY v` into a data.components mapping)
DATA = ["--corpus", "null", "--data.tokenizer", "{corpus}/pydoc/tokenizer"]
TRAIN = "--data.components.c.source.train_urls"
URL = "data.components.c.source.train_urls[0]"

# (id, arguments, what the one-line error must contain)
CASES = [
    # the config file
    ("malformed-yaml", ["--config_path", "{w}/malformed.yaml"], "malformed.yaml is not valid YAML"),
    (
        "non-utf8-yaml",
        ["--config_path", "{w}/latin1.yaml"],
        f"latin1.yaml' is not UTF-8 text (line {Path(TINY).read_text().count(chr(10)) + 2},",
    ),
    (
        "missing-config",
        ["--config_path", "{w}/nothere.yaml"],
        "config file '{w}/nothere.yaml' does not exist (expected a YAML file",
    ),
    ("yaml-list", ["--config_path", "{w}/list.yaml"], "list.yaml' holds a list (expected a mapping of sections"),
    ("empty-yaml", ["--config_path", "{w}/empty.yaml"], "empty.yaml' is empty (expected sections"),
    # keys and types
    (
        "unknown-key-in-file",
        ["--config_path", "{w}/typo.yaml"],
        "`model`: The fields `hiden_dim` are not valid for DiffEqFormerGpt2Config",
    ),
    ("unknown-override", ["--trainer.num_train_stepz", "3"], "unrecognized arguments: --trainer.num_train_stepz"),
    (
        "wrong-type-in-file",
        ["--config_path", "{w}/wrong_type.yaml"],
        "`trainer.num_train_steps`: Couldn't parse 'many' into an int",
    ),
    ("wrong-type-override", ["--model.hidden_dim", "abc"], "`model.hidden_dim`: Couldn't parse 'abc' into an int"),
    (
        "unknown-model-type",
        ["--model.type", "transformer9000"],
        "model.type 'transformer9000' is unknown: expected one of adaptive_gpt2,",
    ),
    ("bad-list-value", ["--trainer.checkpointer.keep", "every 2"], "`trainer.checkpointer.keep`"),
    # impossible values
    (
        "heads-not-dividing-hidden",
        ["--model.num_heads", "3"],
        "num_heads=3 is invalid: expected a divisor of hidden_dim=32",
    ),
    (
        "negative-steps",
        ["--trainer.num_train_steps", "-5"],
        "trainer.num_train_steps=-5 is invalid: expected an integer >= 1",
    ),
    (
        "zero-batch",
        ["--trainer.train_batch_size", "0"],
        "trainer.train_batch_size=0 is invalid: expected an integer >= 1",
    ),
    ("zero-ode-steps", ["--model.ode.num_steps", "0"], "ode.num_steps=0 is invalid: expected an integer >= 1"),
    ("unknown-solver", ["--model.ode.solver", "euler2"], "ode.solver='euler2' is invalid: expected one of"),
    ("zero-time-embed", ["--model.time_embed_dim", "0"], "time_embed_dim=0 is invalid: expected an integer >= 1"),
    (
        "checkpoint-every-0",
        ["--trainer.checkpointer.keep", "[{every: 0}]"],
        "trainer.checkpointer.keep[0].every=0 is invalid",
    ),
    (
        "checkpoint-policy-typo",
        ["--trainer.checkpointer.keep", "[{every:2}]"],
        "trainer.checkpointer.keep[0]={'every:2': None} is invalid",
    ),
    ("log-every-0", ["--log_every", "0"], "log_every=0 is invalid: expected an integer >= 1"),
    ("stop-after-0", ["--stop_after", "0"], "stop_after=0 is invalid"),
    ("nonfinite-mode", ["--nonfinite", "ignore"], "nonfinite='ignore' is invalid: expected one of stop, skip"),
    ("negative-lr", ["--optimizer.learning_rate", "-0.1"], "optimizer.learning_rate=-0.1 is invalid"),
    (
        "negative-weight-decay",
        ["--optimizer.weight_decay", "-0.1"],
        "optimizer.weight_decay=-0.1 is invalid: expected a float >= 0",
    ),
    (
        "steps-per-eval-0",
        ["--trainer.steps_per_eval", "0"],
        "trainer.steps_per_eval=0 is invalid: expected an integer >= 1",
    ),
    (
        "max-eval-batches-negative",
        ["--trainer.max_eval_batches", "-1"],
        "trainer.max_eval_batches=-1 is invalid: expected an integer >= 0 or null",
    ),
    (
        "per-device-parallelism-0",
        ["--trainer.per_device_parallelism", "0"],
        "trainer.per_device_parallelism=0 is invalid: expected an integer >= 1",
    ),
    (
        "per-device-eval-parallelism-0",
        ["--trainer.per_device_eval_parallelism", "0"],
        "trainer.per_device_eval_parallelism=0 is invalid: expected an integer >= 1",
    ),
    (
        "checkpoint-until-0",
        ["--trainer.checkpointer.keep", "[{every: 2, until: 0}]"],
        "trainer.checkpointer.keep[0].until=0 is invalid: expected an integer >= 1 or null",
    ),
    (
        "checkpoint-policy-extra-key",
        ["--trainer.checkpointer.keep", "[{every: 2, after: 3}]"],
        "trainer.checkpointer.keep[0]={'every': 2, 'after': 3} is invalid: expected {every: N} or {every: N, until: M}",
    ),
    ("negative-epochs", ["--epochs", "-1"], "epochs=-1 is invalid: expected an integer >= 0"),
    ("negative-z-loss", ["--z_loss_weight", "-0.5"], "z_loss_weight=-0.5 is invalid: expected a float >= 0"),
    ("run-id-with-space", ["--trainer.id", "my run"], "trainer.id='my run' is invalid: expected a plain name without"),
    ("run-id-with-slash", ["--trainer.id", "a/b"], "trainer.id='a/b' is invalid"),
    ("run-id-parent", ["--trainer.id", ".."], "trainer.id='..' is invalid: expected a plain name"),
    ("run-id-dot", ["--trainer.id", "."], "trainer.id='.' is invalid: expected a plain name"),
    ("run-id-empty", ["--trainer.id", ""], "trainer.id='' is invalid: expected a plain name"),
    (
        "unknown-corpus",
        ["--corpus.name", "wikipedia"],
        "corpus.name='wikipedia' is invalid: expected one of pydoc, tinyshakespeare",
    ),
    ("corpus-vocab-0", ["--corpus.vocab_size", "0"], "corpus.vocab_size=0 is invalid"),
    (
        "corpus-eval-split",
        ["--corpus.eval_split", "tst"],
        "corpus.eval_split='tst' is invalid: expected one of validation, selection, test",
    ),
    # data files and the tokenizer
    (
        "missing-data",
        [*DATA, TRAIN, "[{w}/data/missing.jsonl]"],
        URL + ": file '{w}/data/missing.jsonl' does not exist",
    ),
    ("empty-data", [*DATA, TRAIN, "[{w}/data/empty.jsonl]"], URL + ": file '{w}/data/empty.jsonl' is empty"),
    ("blank-data", [*DATA, TRAIN, "[{w}/data/blank.jsonl]"], "blank.jsonl' holds only whitespace"),
    (
        "txt-data",
        [*DATA, TRAIN, "[{w}/data/plain.txt]"],
        URL
        + ": '{w}/data/plain.txt' is a .txt file, which Levanter's URL data does not read; expected .jsonl, .json or .parquet",
    ),
    (
        "jsonl-bad-later-line",
        [*DATA, TRAIN, "[{w}/data/bad_line_3.jsonl]"],
        URL + ": file '{w}/data/bad_line_3.jsonl' line 3 is not JSON",
    ),
    (
        "jsonl-later-line-no-text",
        [*DATA, TRAIN, "[{w}/data/no_text_line_2.jsonl]"],
        "no_text_line_2.jsonl' line 2 has no string field 'text'",
    ),
    ("jsonl-blank-line", [*DATA, TRAIN, "[{w}/data/blank_line_2.jsonl]"], "blank_line_2.jsonl' line 2 is blank"),
    ("txt-data-remote", [*DATA, TRAIN, "[gs://bucket/corpus.txt]"], URL + ": 'gs://bucket/corpus.txt' is a .txt file"),
    (
        "glob-matches-nothing",
        [*DATA, TRAIN, "[{w}/data/nothing*.jsonl]"],
        URL + ": '{w}/data/nothing*.jsonl' matches no files",
    ),
    (
        "glob-matches-bad-file",
        [*DATA, TRAIN, "[{w}/data/bad_line_*.jsonl]"],
        URL + ": file '{w}/data/bad_line_3.jsonl' line 3",
    ),
    ("non-utf8-data", [*DATA, TRAIN, "[{w}/data/latin1.jsonl]"], "latin1.jsonl' is not UTF-8 text (byte 13"),
    ("jsonl-not-json", [*DATA, TRAIN, "[{w}/data/not_json.jsonl]"], "not_json.jsonl' line 1 is not JSON"),
    (
        "jsonl-no-text-field",
        [*DATA, TRAIN, "[{w}/data/no_text.jsonl]"],
        "no_text.jsonl' line 1 has no string field 'text'",
    ),
    (
        "data-is-a-folder",
        [*DATA, TRAIN, "[{w}/data/folder]"],
        "folder' is a folder (expected a .jsonl, .json or .parquet file",
    ),
    (
        "no-data-components",
        ["--corpus", "null"],
        "data.components is empty: expected a dataset (data.components.<name>.source",
    ),
    (
        "no-training-data",
        [*DATA, TRAIN, "[]"],
        "data: no component has training data: expected data.components.<name>.source.train_urls",
    ),
    (
        "missing-validation-data",
        [*DATA, TRAIN, "[{corpus}/pydoc/train.jsonl]", "--data.components.c.source.validation_urls", "[{w}/v.jsonl]"],
        "data.components.c.source.validation_urls[0]: file '{w}/v.jsonl' does not exist",
    ),
    (
        "missing-data-second-url",
        [*DATA, TRAIN, "[{corpus}/pydoc/train.jsonl, {w}/data/missing.jsonl]"],
        "data.components.c.source.train_urls[1]: file '{w}/data/missing.jsonl' does not exist",
    ),
    (
        "missing-data-second-component",
        [
            *DATA,
            TRAIN,
            "[{corpus}/pydoc/train.jsonl]",
            "--data.components.d.source.train_urls",
            "[{w}/data/empty.jsonl]",
        ],
        "data.components.d.source.train_urls[0]: file '{w}/data/empty.jsonl' is empty",
    ),
    (
        "no-text-field-named-by-format",
        [*DATA, TRAIN, "[{w}/data/no_text.jsonl]", "--data.components.c.format", "{type: text, text_key: body}"],
        "no_text.jsonl' line 1 has no string field 'body'",
    ),
    (
        "unset-tokenizer",
        [*DATA, TRAIN, "[{corpus}/pydoc/train.jsonl]", "--data.tokenizer", "null"],
        "data.tokenizer is not set",
    ),
    (
        "missing-tokenizer",
        [*DATA, TRAIN, "[{corpus}/pydoc/train.jsonl]", "--data.tokenizer", "{w}/no_tokenizer"],
        "data.tokenizer: '{w}/no_tokenizer' does not exist",
    ),
    (
        "broken-tokenizer",
        [*DATA, TRAIN, "[{corpus}/pydoc/train.jsonl]", "--data.tokenizer", "{w}/broken_tokenizer"],
        "data.tokenizer='{w}/broken_tokenizer' could not be loaded",
    ),
    ("not-a-checkpoint", ["--trainer.load_checkpoint_path", "{w}/checkpoints/junk"], "is not a readable checkpoint"),
]


@pytest.mark.parametrize("args,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_anything_starts(world, corpus_root, capsys, monkeypatch, args, message):
    import qkvflow.training.session

    def tripwire(config, before_writes=None):
        raise Tripwire("bad input reached JAX's initialisation")

    monkeypatch.setattr(qkvflow.training.session, "_initialize", tripwire)
    monkeypatch.chdir(world)
    before = _snapshot(world / "checkpoints")
    rc, err = _run_cli(world, corpus_root, args, capsys)
    _assert_refused(rc, err, _fill(message, world, corpus_root))
    assert _snapshot(world / "checkpoints") == before


def _assert_refused(rc, err, message):
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("qkvflow train: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err


# Sizes that depend on the devices (preflight.check_devices, after JAX's initialisation): the test
# process has one CPU device. Levanter 1.2's `--trainer.model_axis_size 3` is trainer.mesh.axes.model.
DEVICES = [
    (
        "mesh-model-axis-too-big",
        ["--trainer.mesh.axes", "{data: -1, replica: 1, model: 3}"],
        "trainer.mesh.axes={'data': -1, 'replica': 1, 'model': 3} does not fit the 1 available devices (",
    ),
    (
        "mesh-data-axis-too-big",
        ["--trainer.mesh.axes", "{data: 2, replica: 1, model: 1}"],
        "trainer.mesh.axes={'data': 2, 'replica': 1, 'model': 1} does not fit the 1 available devices (",
    ),
    (
        "mesh-two-absorbing-axes",
        ["--trainer.mesh.axes", "{data: -1, replica: -1, model: 1}"],
        "trainer.mesh.axes={'data': -1, 'replica': -1, 'model': 1} does not fit",
    ),
    (
        "mesh-axis-0",
        ["--trainer.mesh.axes", "{data: -1, replica: 1, model: 0}"],
        "trainer.mesh.axes.model=0 is invalid: expected an integer >= 1",
    ),
]


@pytest.mark.parametrize("args,message", [c[1:] for c in DEVICES], ids=[c[0] for c in DEVICES])
def test_a_mesh_that_does_not_fit_the_devices_is_refused(world, corpus_root, capsys, monkeypatch, args, message):
    import qkvflow.training.session
    from qkvflow.training import preflight

    def initialize(config, before_writes=None):
        preflight.check_devices(config.trainer)
        raise Tripwire("a mesh that does not fit passed the device check")

    monkeypatch.setattr(qkvflow.training.session, "_initialize", initialize)
    monkeypatch.chdir(world)
    before = _snapshot(world / "checkpoints")
    rc, err = _run_cli(world, corpus_root, args, capsys)
    _assert_refused(rc, err, message)
    assert _snapshot(world / "checkpoints") == before


@pytest.mark.parametrize("axes, batch, message", [
    ({"data": -1, "replica": 1, "model": 1}, 6, "trainer.train_batch_size=6 is not divisible by the data-parallel size 4 (4 devices, "
     "trainer.mesh.axes={'data': -1, 'replica': 1, 'model': 1}); pick a multiple of 4"),
    ({"data": -1, "replica": 1, "model": 2}, 6, None),  # 2-way tensor parallelism: data-parallel size 2
    ({"data": -1, "replica": 1, "model": 2}, 5, "trainer.train_batch_size=5 is not divisible by the data-parallel size 2"),
    ({"data": -1, "replica": 1, "model": 8}, 8, "trainer.mesh.axes={'data': -1, 'replica': 1, 'model': 8} does not fit the 4 available devices"),
])  # fmt: skip
def test_batch_sizes_divide_over_the_meshs_data_parallel_size(monkeypatch, axes, batch, message):
    """check_batch on 4 (pretended) devices: the batch divides over data x replica, not over the model axis."""
    import jax
    from levanter.trainer import TrainerConfig
    from levanter.utils.mesh import MeshConfig

    from qkvflow.errors import UserError
    from qkvflow.training import preflight

    monkeypatch.setattr(jax, "device_count", lambda *a: 4)
    config = TrainerConfig(train_batch_size=batch, mesh=MeshConfig(axes=axes))
    if message is None:
        preflight.check_batch(config)
        return
    with pytest.raises(UserError) as error:
        preflight.check_batch(config)
    assert message in str(error.value) and "\n" not in str(error.value)


# The checkpoint of run `tiny` was written for base.yaml's model (GPT-2 flavour, hidden 32, vocabulary
# 2048). Resuming it with a model or tokenizer that does not fit must fail at the resume check.
RESUME = [
    (
        "tokenizer-vocab-differs",
        ["--corpus.root", "{w}/corpus_512", "--corpus.vocab_size", "512"],
        "model.token_embeddings.weight has shape (2048, 32) but this config's DiffEqFormerGpt2Config needs (vocab=512, embed=32); the tokenizer's vocabulary",
    ),
    (
        "other-model-type",
        [
            "--model.type",
            "diffeqformer_llama",
            "--model.max_seq_len",
            "32",
            "--model.hidden_dim",
            "32",
            "--model.num_heads",
            "2",
            "--model.time_embed_dim",
            "8",
            "--model.num_frequencies",
            "16",
        ],
        # the stacked hypernetworks: Llama's SwiGLU field generates one matrix more than GPT-2's (7 against 6),
        # so the matrix MLPs' stack differs in length before any array is missing
        "but this config's DiffEqFormerLlamaConfig needs (stacked=7",
    ),
    (
        "other-width",
        ["--model.hidden_dim", "64"],
        (
            "model.token_embeddings.weight has shape (2048, 32) but this config's DiffEqFormerGpt2Config needs (vocab=2048, embed=64); "
            "embed=32 in the checkpoint vs 64 here (set by model.hidden_dim)"
        ),
    ),
]


@pytest.mark.parametrize("args,message", [c[1:] for c in RESUME], ids=[c[0] for c in RESUME])
def test_checkpoint_that_does_not_fit_the_config_is_refused(world, corpus_root, capsys, monkeypatch, args, message):
    import qkvflow.training.loop
    import qkvflow.training.session

    def trainer_tripwire(*args, **kwargs):
        raise Tripwire("a checkpoint that does not fit reached the trainer")

    monkeypatch.setattr(qkvflow.training.session, "_initialize", initialize_without_writes)
    monkeypatch.setattr(qkvflow.training.session, "build_caches", trainer_tripwire)  # what follows the resume check
    monkeypatch.chdir(world)
    before = _snapshot(world / "checkpoints")
    rc, err = _run_cli(world, corpus_root, args, capsys)
    _assert_refused(rc, err, message)
    assert f"checkpoint '{world / 'checkpoints' / 'tiny' / 'step-5'}'" in err
    assert _snapshot(world / "checkpoints") == before


def test_the_checkpoint_fits_its_own_config(world, corpus_root, capsys, monkeypatch):
    """The control for the table above: the same checkpoint with base.yaml passes the resume check."""
    import qkvflow.training.loop
    import qkvflow.training.session

    def trainer_tripwire(*args, **kwargs):
        raise Tripwire("reached the trainer")

    monkeypatch.setattr(qkvflow.training.session, "_initialize", initialize_without_writes)
    monkeypatch.setattr(qkvflow.training.session, "build_caches", trainer_tripwire)  # what follows the resume check
    with pytest.raises(Tripwire):
        _run_cli(world, corpus_root, [], capsys)


LONG = 16384  # test_data_shorter_...: a sequence longer than the pydoc corpus's validation split


@pytest.fixture(scope="module")
def whole_commands(world, corpus_root, tmp_path_factory):
    """The cases below that run the whole command, JAX start-up and Levanter's trainer included, one after
    another in one fresh process with 2 devices (tests/train_utils.cli_in_one_process: one start-up for
    all): {case: (its folder, exit code, stdout, stderr)}, and the world's checkpoints before them."""
    folders = {case: tmp_path_factory.mktemp(f"whole-{case}") for case in ("resume", "short", "unwritable")}
    resume = [
        "train", "--config_path", str(world / "base.yaml"), "--corpus.root", str(corpus_root),
        "--trainer.checkpointer.base_path", str(world / "checkpoints"),
        "--trainer.tracker", f"{{type: jsonl, path: {folders['resume'] / 'runs'}}}",
        "--trainer.log_dir", str(folders["resume"] / "logs"),
    ]  # fmt: skip
    cases = {
        "resume": resume,
        "short": train_args(folders["short"], corpus_root, "--model.max_seq_len", str(LONG), run_id="long")[3:],
        "unwritable": train_args(
            folders["unwritable"], folders["unwritable"] / "corpora",
            "--trainer.checkpointer.base_path", "/proc/qkvflow-test/checkpoints",
        )[3:],
    }  # fmt: skip
    before = _snapshot(world / "checkpoints")
    results = cli_in_one_process(cases, train_env(2), cwd=tmp_path_factory.mktemp("whole-cwd"))
    return {case: (folders[case], *results[case]) for case in cases}, before


def test_end_to_end_in_a_subprocess(world, whole_commands):
    """Resuming run `tiny`, whose checkpoint holds the model but no optimizer state, fails at the restore
    with one short line naming the checkpoint and a few of the missing arrays (Levanter's own error lists
    all of them)."""
    runs, before = whole_commands
    _, code, _, stderr = runs["resume"]
    step = world / "checkpoints" / "tiny" / "step-5"
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("qkvflow train: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert f"checkpoint '{step}' lacks " in errors[0] and re.search(r"\(no [^)]*opt_state[^)]* at all\)", errors[0]), (
        errors[0]
    )
    assert re.search(r": [\w.]+, [\w.]+, [\w.]+ and \d+ more;", errors[0]), errors[0]
    assert len(errors[0]) < 600 and "Traceback" not in stderr
    assert _snapshot(world / "checkpoints") == before


def test_data_shorter_than_one_sequence_is_refused_after_tokenizing(corpus_root, whole_commands):
    """A split that passes every file check but holds fewer tokens than one sequence (Levanter's eval
    loader used to fail with an IndexError): one line naming the split, its token count and the
    sequence length, exit 2, before the run writes anything. The session's pydoc corpus and its Levanter cache are
    reused: its validation split (8 documents) is shorter than 16384 tokens, its train split is not."""
    import json

    from transformers import AutoTokenizer

    seq_len = LONG
    tokenizer = AutoTokenizer.from_pretrained(str(corpus_root / "pydoc" / "tokenizer"))
    with open(corpus_root / "pydoc" / "validation.jsonl") as f:
        docs = [json.loads(line)["text"] for line in f]
    tokens = sum(len(tokenizer(doc)["input_ids"]) for doc in docs)
    assert tokens < seq_len
    workdir, code, _, stderr = whole_commands[0]["short"]
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("qkvflow train: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    found = re.search(
        rf"data: the validation split holds (\d+) tokens, fewer than one sequence of model.max_seq_len={seq_len} ",
        errors[0],
    )
    assert found and tokens <= int(found.group(1)) <= tokens + 2 * len(docs), errors[0]  # + BOS/EOS per document
    # refused before the run's first write: no run folder (lock file), no tracker file, no log
    assert not (workdir / "checkpoints" / "long").exists() and not (workdir / "runs" / "long").exists()


@pytest.mark.parametrize(
    "tokens,refused",
    [
        ({"train": 32, "validation": 32}, None),
        ({"train": 31}, "train"),
        ({"train": 500, "validation": 0}, "validation"),
    ],
)
def test_each_split_needs_one_sequence(tokens, refused):
    """Levanter cuts each split into sequences of exactly max_seq_len tokens: max_seq_len tokens make one."""
    from qkvflow.errors import UserError
    from qkvflow.runs import data_checks

    if refused is None:
        data_checks.check_data_size(tokens, 32)
        return
    with pytest.raises(
        UserError,
        match=f"the {refused} split holds {tokens[refused]} tokens, fewer than one sequence of model.max_seq_len=32",
    ):
        data_checks.check_data_size(tokens, 32)


def _ocdbt(step: Path):
    """The OCDBT key-value store marin-levanter writes a checkpoint into (`step-N/manifest.ocdbt`, `d/`)."""
    import tensorstore as ts
    from levanter.tensorstore_serialization import build_kvstore_spec

    return ts.KvStore.open({"driver": "ocdbt", "base": build_kvstore_spec(str(step))}).result()


def _truncate_a_data_file(step: Path) -> str:
    """Cut the largest data file of the store in half. It holds array chunks and may hold b-tree nodes
    of the store's index: whichever tensorstore reads first is named (the array and its chunk, or the
    database file), and which comes first is not fixed (tensorstore reads concurrently)."""
    data = max((step / "d").iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(data, data.stat().st_size // 2)
    return (
        rf"(its OCDBT database file 'd/{data.name}' is damaged \("
        r"|array model\.[\w.+]+ cannot be read, its chunk '[\d/]+' is damaged \()"
    )


def _remove_the_generator(step: Path) -> str:
    """Delete every key of the hypernetwork's arrays (metadata and chunks) from the store."""
    import tensorstore as ts

    from qkvflow.runs.checkpoint_arrays import array_shapes

    n = sum(key.startswith("model/generator/") for key in array_shapes(str(step)))
    assert n > 3
    range_ = ts.KvStore.KeyRange(inclusive_min="model/generator/", exclusive_max="model/generator0")
    _ocdbt(step).delete_range(range_).result()
    assert not any(key.startswith("model/generator/") for key in array_shapes(str(step)))
    return re.escape(
        f"does not hold a DiffEqFormerGpt2Config model as the config describes: it lacks {n} of its arrays (model.generator."
    )


@pytest.mark.parametrize(
    "damage", [_truncate_a_data_file, _remove_the_generator], ids=["truncated-data-file", "missing-arrays"]
)
def test_damaged_checkpoint_is_named_in_one_short_line(world, corpus_root, tmp_path, damage):
    """Reading a damaged checkpoint back (qkvflow.runs.model.load_model, as export and analyze do):
    one line naming the checkpoint and the damaged file or the missing arrays (at most three names, not
    Levanter's list)."""
    from qkvflow.errors import UserError
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.model import load_model
    from tests.helpers import parse_config

    run, intact = tmp_path / "tiny", tmp_path / "intact" / "tiny"
    shutil.copytree(world / "checkpoints" / "tiny", run)
    shutil.copytree(world / "checkpoints" / "tiny", intact)
    config = parse_config(world / "base.yaml", TrainConfig, ["--corpus.root", str(corpus_root)])
    load_model(config, str(intact))  # the control: an intact copy loads (another path: tensorstore caches what it read)
    expected = damage(run / "step-5")
    with pytest.raises(UserError) as error:
        load_model(config, str(run))
    message = str(error.value)
    assert message.startswith(f"checkpoint '{run / 'step-5'}'") and re.search(expected, message), message
    assert "\n" not in message and len(message) < 500 and message.count("model.generator.") <= 3, message


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(ROOT)) for d in ("configs", "tests/configs") for p in (ROOT / d).rglob("*.yaml"))
)
def test_shipped_configs_pass_the_value_checks(path):
    """No false alarms: every shipped config passes the checks that need no data or devices."""
    from qkvflow.training import preflight
    from tests.helpers import config_class, parse_config

    preflight.check_config_file(str(ROOT / path))
    preflight.check_values(parse_config(ROOT / path, config_class(ROOT / path)))


# Output locations that cannot be written: refused by the write probe before the corpus, the
# tokenizer or Levanter's initialisation (both replaced by tripwires here).
UNWRITABLE = [
    (
        "checkpoints-under-proc",
        ["--trainer.checkpointer.base_path", "/proc/qkvflow-test/checkpoints"],
        "trainer.checkpointer.base_path='/proc/qkvflow-test/checkpoints' cannot be written",
    ),
    (
        "checkpoints-is-a-file",
        ["--trainer.checkpointer.base_path", "{w}/base.yaml"],
        "trainer.checkpointer.base_path='{w}/base.yaml' is a file",
    ),
    (
        "tracker-inside-a-file",
        ["--trainer.tracker", "{type: jsonl, path: {w}/base.yaml/runs}"],
        "trainer.tracker.path='{w}/base.yaml/runs' is inside {w}/base.yaml, which is a file",
    ),
    (
        "tensorboard-under-proc",
        ["--trainer.tracker", "[{type: jsonl, path: {w}/runs}, {type: tensorboard, logdir: /proc/qkvflow-test/tb}]"],
        "trainer.tracker[1].logdir='/proc/qkvflow-test/tb' cannot be written",
    ),
    (
        "log-dir-under-proc",
        ["--trainer.log_dir", "/proc/qkvflow-test/logs"],
        "trainer.log_dir='/proc/qkvflow-test/logs' cannot be written",
    ),
]


@pytest.mark.parametrize("args,message", [c[1:] for c in UNWRITABLE], ids=[c[0] for c in UNWRITABLE])
def test_unwritable_outputs_are_refused_before_any_work(world, corpus_root, capsys, monkeypatch, args, message):
    import qkvflow.training.session

    def tripwire(config, before_writes=None):
        raise Tripwire("an unwritable output reached the corpus or JAX's initialisation")

    monkeypatch.setattr(qkvflow.training.session, "with_corpus", tripwire)
    monkeypatch.setattr(qkvflow.training.session, "_initialize", tripwire)
    monkeypatch.chdir(world)

    def files():
        return {p: s for p, s in _snapshot(world).items() if not os.path.isdir(p)} | {"all": sorted(world.rglob("*"))}

    before = files()  # (the probe changes the mtime of the folder it probes, nothing else)
    rc, err = _run_cli(world, corpus_root, args, capsys)
    _assert_refused(rc, err, _fill(message, world, corpus_root))
    assert files() == before


def test_unreadable_checkpoint_metadata_stops_and_keeps_the_checkpoint(
    world, corpus_root, capsys, monkeypatch, tmp_path
):
    """metadata.json of the newest checkpoint corrupted: one line naming the folder and how to resume;
    the folder is not deleted and training does not restart from step 0."""
    import shutil

    import qkvflow.training.loop
    import qkvflow.training.session

    def trainer_tripwire(*args, **kwargs):
        raise Tripwire("a run with an unreadable checkpoint reached the trainer")

    shutil.copytree(world / "checkpoints" / "tiny", tmp_path / "checkpoints" / "tiny")
    step = tmp_path / "checkpoints" / "tiny" / "step-5"
    (step / "metadata.json").write_text('{"step": garbage')
    monkeypatch.setattr(qkvflow.training.session, "_initialize", initialize_without_writes)
    monkeypatch.setattr(qkvflow.training.session, "build_caches", trainer_tripwire)  # what follows the resume check
    monkeypatch.chdir(world)
    before = _snapshot(tmp_path / "checkpoints")
    rc, err = _run_cli(world, corpus_root, ["--trainer.checkpointer.base_path", str(tmp_path / "checkpoints")], capsys)
    _assert_refused(rc, err, f"checkpoint {step}: its metadata.json is not valid JSON")
    assert f"mv {step} " in err
    assert _snapshot(tmp_path / "checkpoints") == before


def test_unwritable_checkpoints_end_to_end(whole_commands):
    """The whole command: exit 2 and one line, with no corpus built and nothing trained."""
    workdir, code, _, stderr = whole_commands[0]["unwritable"]
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.strip()]
    expected = (
        "qkvflow train: error: trainer.checkpointer.base_path='/proc/qkvflow-test/checkpoints' cannot be written "
        "(creating a file in /proc failed: No such file or directory): expected a folder that qkvflow can write to"
    )
    assert errors == [expected], stderr[-3000:]
    assert sorted(p.name for p in workdir.iterdir()) == []  # no corpus, no metrics, no logs
