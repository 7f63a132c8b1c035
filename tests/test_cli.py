import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]


def run(*args, check=True):
    return subprocess.run(
        [sys.executable, "-m", "qkvflow", *args], cwd=ROOT, capture_output=True, text=True, check=check
    )


def cli(capsys, *args) -> tuple[int, str, str]:
    """`qkvflow ARGS` in this process: (exit status, stdout, stderr)."""
    from qkvflow.cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_qkvflow_process_collects_garbage_less_often(capsys):
    """`qkvflow.cli.main` raises the collector's thresholds from Python's (700, 10, 10) to (20000, 20, 20)
    for the process it runs in (qkvflow.cli.collect_less: 2.8 s of a tiny run's 20 s was collection at Python's)."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        assert cli(capsys, "--help")[0] == 0
        assert gc.get_threshold() == (20_000, 20, 20)
    finally:
        gc.set_threshold(*before)


def test_help_lists_verbs():
    out = run("--help").stdout
    assert "train" in out and "describe" in out


def test_unknown_verb_fails_with_usage():
    proc = run("frobnicate", check=False)
    assert proc.returncode == 2 and "unknown verb 'frobnicate'" in proc.stderr


def test_describe_applies_overrides(capsys):
    rc, out, err = cli(capsys, "describe", "--config_path", str(ROOT / "configs/models/medium_d144.yaml"),
                       "--model.time_embed_dim", "20")  # fmt: skip
    assert rc == 0, err
    out = json.loads(out)
    assert 295e6 < out["total_params"] < 310e6
    assert out["ode_evaluations"] == 24
    assert out["vocab_size"] == 50257  # no data section: Levanter's default tokenizer, gpt2


def test_describe_counts_the_corpus_tokenizers_vocabulary(capsys, corpus_root, tmp_path):
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(str(corpus_root / "pydoc" / "tokenizer")))
    hidden, seq_len = 128, 128  # configs/quickstart.yaml
    rc, out, err = cli(capsys, "describe", "--config_path", str(ROOT / "configs/quickstart.yaml"))
    assert rc == 0, err
    out = json.loads(out)
    assert out["vocab_size"] == tokens == 2048
    assert out["embedding_params"] == (tokens + seq_len) * hidden  # tied token embedding + positions
    assert 3.4e6 < out["total_params"] < 3.6e6  # docs/quickstart.md: 3.5M parameters
    rc, out, err = cli(capsys, "describe", "--config_path", str(ROOT / "configs/quickstart.yaml"),
                       "--corpus.root", str(tmp_path / "nothing"), "--corpus.vocab_size", "1000")  # fmt: skip
    assert rc == 0 and json.loads(out)["vocab_size"] == 1000
    assert not (tmp_path / "nothing").exists()  # describe builds nothing


HELP = {  # verb: options and sections its --help must name
    "train": ["--stop_after", "--epochs", "--nonfinite", "--verbose", "model", "corpus"],
    "finetune": ["--steps", "--finetune", "--verbose", "pretrained", "lora", "export"],
    "sweep": ["--depths", "--methods", "--steps", "pretrained", "sweep"],
}


@pytest.mark.parametrize("verb", sorted(HELP))
def test_help_is_one_screen_of_options_and_sections(capsys, verb):
    rc, out, err = cli(capsys, verb, "--help")
    assert rc == 0, err
    assert len(out.splitlines()) < 80, f"{verb} --help prints {len(out.splitlines())} lines"
    assert out.startswith(f"usage: qkvflow {verb} --config_path CFG")
    for name in ["--config_path", "data", "trainer", "optimizer", *HELP[verb]]:
        pattern = rf"^  {re.escape(name)}\s" if not name.startswith("--") else rf"^  {re.escape(name)}\b"
        assert re.search(pattern, out, re.MULTILINE), f"{verb} --help does not list {name}"
    assert f"qkvflow {verb} --help-all" in out
    assert re.search(r"^  --verbose {2,}Show Levanter's log lines", out, re.MULTILINE)  # a bare flag, no value


def test_help_all_lists_every_key(capsys):
    with pytest.raises(SystemExit) as exit:
        cli(capsys, "train", "--help-all")
    out = capsys.readouterr().out
    assert exit.value.code == 0
    assert "--trainer.checkpointer.base_path" in out and "--model.ode.num_steps" in out
    assert len(out.splitlines()) > 2000  # qkvflow.cli.startup.usage: "thousands of lines" (4,278 on 2026-11-28)
    said = re.search(
        r"`--help-all` lists every key with its default \(about ([\d,]+)\s", (ROOT / "docs" / "training.md").read_text()
    )
    assert said and abs(len(out.splitlines()) / int(said.group(1).replace(",", "")) - 1) < 0.1, len(out.splitlines())


def test_the_overview_lists_every_bench_mode(capsys):
    from qkvflow.cli.bench import MODES

    rc, out, _ = cli(capsys, "--help")
    line = next(line for line in out.splitlines() if line.split()[:1] == ["bench"])
    assert rc == 0 and all(f" {mode} " in line or f" {mode}:" in line for mode in MODES), line


# --- Levanter 1.2 keys: refused by every verb before it runs (qkvflow.runs.compat, from qkvflow.cli.main) ------


OLD_FILE = "trainer:\n  id: old\n  fsdp_axis: embed\nmodel:\n  seq_len: 64\n"


@pytest.fixture()
def no_verb(monkeypatch):
    """The verb's module is never imported: the old key is refused before any verb code or parsing runs."""
    import qkvflow.cli

    def tripwire(name):
        raise AssertionError(f"{name} was imported: the old key was not refused first")

    monkeypatch.setattr(qkvflow.cli.importlib, "import_module", tripwire)


# verb and its arguments besides --config_path (export and analyze need their own)
VERB_ARGS = {
    "train": [],
    "finetune": [],
    "sweep": ["--depths", "2"],
    "describe": [],
    "export": ["--checkpoint", "ckpt", "--output", "out"],
    "analyze": ["spectra", "--checkpoint", "ckpt"],
    "bench": ["speed"],
}


@pytest.mark.parametrize("verb", sorted(VERB_ARGS))
def test_every_verb_refuses_an_old_config_file_in_one_line(capsys, tmp_path, no_verb, verb):
    old = tmp_path / "old.yaml"
    old.write_text(OLD_FILE)
    rc, out, err = cli(capsys, verb, *VERB_ARGS[verb][:1], "--config_path", str(old), *VERB_ARGS[verb][1:])
    assert rc == 2 and out == ""
    assert err == (
        f"qkvflow {verb}: error: {old}: trainer.fsdp_axis was removed in marin-levanter; use trainer.mesh.param_mapping "
        "(e.g. {embed: data}) (also old: model.seq_len)\n"
    )


@pytest.mark.parametrize(
    "verb, override, replacement",
    [
        ("train", ["--model.seq_len", "64"], "use model.max_seq_len"),
        ("train", ["--data.train_urls=[a.jsonl]"], "use data.components.<name>.source.train_urls"),
        ("finetune", ["--trainer.model_axis_size", "2"], "use trainer.mesh.axes.model"),
        ("finetune", ["--trainer.ray.auto_start_cluster", "false"], "delete: marin-levanter starts no Ray cluster"),
        ("export", ["--trainer.tensor_parallel_axes", "[mlp, heads]"], "use trainer.mesh.shared_mapping"),
        ("sweep", ["--data.id", "x"], "use data.components.<name>.source.id"),
        ("describe", ["--trainer.profiler", "true"], "use trainer.profiler.enabled"),
    ],
)
def test_old_override_keys_are_refused_in_one_line(capsys, no_verb, verb, override, replacement):
    config = ROOT / (
        "configs/finetune/quickstart_lora.yaml" if verb in ("finetune", "sweep") else "configs/quickstart.yaml"
    )
    rc, out, err = cli(capsys, verb, "--config_path", str(config), *VERB_ARGS[verb], *override)
    key = override[0][2:].split("=")[0]
    assert rc == 2 and out == ""
    assert err.startswith(f"qkvflow {verb}: error: command line: {key} was removed in marin-levanter; {replacement}")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "override,in_file,message",
    [
        (
            ["--trainer.num_train_steps", "abc"],
            "num_train_steps: 300",
            "`trainer.num_train_steps`: Couldn't parse 'abc'",
        ),
        (["--model.ode.solver=foo"], "solver: euler", "ode.solver='foo' is invalid: expected one of"),
        (["--model.num_heads", "5"], "num_heads: 4", "num_heads=5 is invalid: expected a divisor of hidden_dim=128"),
    ],
)
def test_a_bad_value_is_blamed_on_where_it_was_given(capsys, tmp_path, override, in_file, message):
    """A bad value given on the command line is reported as a command-line error naming the flag; the
    same value written in the config file is reported as an error in that file."""
    config = ROOT / "configs" / "quickstart.yaml"
    rc, out, err = cli(capsys, "describe", "--config_path", str(config), *override)
    flag = override[0].split("=")[0]
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"qkvflow describe: error: command line ({flag}): {message}"), err
    key, value = flag.rsplit(".", 1)[-1], override[-1].split("=")[-1]
    text = config.read_text()
    assert in_file in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(in_file, f"{key}: {value}", 1))
    rc, out, err = cli(capsys, "describe", "--config_path", str(bad))
    assert rc == 2 and err.startswith(f"qkvflow describe: error: {bad}: "), err
    assert message.split(": ", 1)[-1] in err


@pytest.mark.parametrize("override", [["--trainer.id", "a\tb"], ["--trainer.id=a\tb"]], ids=["spaced", "equals"])
def test_a_value_that_is_not_yaml_is_blamed_on_its_flag(capsys, override):
    """draccus reads every command-line value as YAML; one that is not (a tab) is one line naming the flag."""
    config = ROOT / "configs" / "quickstart.yaml"
    rc, out, err = cli(capsys, "describe", "--config_path", str(config), "--trainer.seed", "1", *override)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("qkvflow describe: error: command line (--trainer.id): 'a\\tb' is not valid YAML: "), err


def test_an_old_config_is_refused_end_to_end(tmp_path):
    """The installed command in a fresh process: exit 2, one line on stderr, nothing written."""
    old = tmp_path / "old.yaml"
    old.write_text(OLD_FILE)
    proc = subprocess.run([sys.executable, "-m", "qkvflow", "train", "--config_path", str(old)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=limit(300))  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"qkvflow train: error: {old}: trainer.fsdp_axis was removed in marin-levanter; use trainer.mesh.param_mapping "
        "(e.g. {embed: data}) (also old: model.seq_len)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.yaml"]


def test_the_check_finds_a_config_named_without_its_extension(capsys, tmp_path, no_verb):
    """Levanter reads `--config_path x` as x.yaml; the old-key check reads the same file."""
    (tmp_path / "old.yaml").write_text(OLD_FILE)
    rc, _, err = cli(capsys, "train", "--config_path", str(tmp_path / "old"))
    assert rc == 2 and f"{tmp_path / 'old.yaml'}: trainer.fsdp_axis was removed" in err


# --- overrides draccus cannot read as written (qkvflow.cli.overrides) ------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--verbose"], ["--verbose", "true"]),
        (["--verbose", "--trainer.id", "r"], ["--verbose", "true", "--trainer.id", "r"]),
        (["--verbose", "false"], ["--verbose", "false"]),
        (["--verbose=false"], ["--verbose=false"]),
        (["--data.components.owt.cache_dir", "/fast/owt", "--trainer.id", "r"],
         ["--data.components", '{"owt": {"cache_dir": "/fast/owt"}}', "--trainer.id", "r"]),
        (["--data.components.a.source.train_urls=[x.jsonl, y.jsonl]", "--log_every", "1",
          "--data.components.a.source.validation_fraction", "0.001", "--data.components.b.source", "{type: hf, id: z}"],
         ["--data.components", '{"a": {"source": {"train_urls": ["x.jsonl", "y.jsonl"], "validation_fraction": "0.001"}}, '
          '"b": {"source": {"type": "hf", "id": "z"}}}', "--log_every", "1"]),
        (["--data.components", "{a: {}}", "--data.tokenizer", "gpt2"], ["--data.components", "{a: {}}", "--data.tokenizer", "gpt2"]),
    ],
)  # fmt: skip
def test_overrides_for_draccus(args, expected):
    from qkvflow.cli import overrides

    assert overrides("train", args) == expected


def test_bare_flags_only_for_the_config_verbs():
    from qkvflow.cli import overrides

    assert overrides("bench", ["speed", "--verbose"]) == ["speed", "--verbose"]  # bench's own argparse options
    assert overrides("finetune", ["--verbose"]) == ["--verbose", "true"]


def test_components_given_whole_and_by_key_is_one_line_error(capsys, no_verb):
    rc, _, err = cli(capsys, "train", "--config_path", str(ROOT / "configs/quickstart.yaml"),
                     "--data.components", "{a: {}}", "--data.components.a.cache_dir", "x")  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and "--data.components is given whole and also by key" in err


@pytest.mark.parametrize(
    "verb, config",
    [("train", "configs/paper/owt_small_ode.yaml"), ("finetune", "configs/finetune/quickstart_lora.yaml")],
)
def test_bare_verbose_and_component_keys_reach_the_config(capsys, monkeypatch, verb, config):
    """`--verbose` alone sets TrainConfig.verbose (Levanter's log lines on the terminal) for train and
    finetune; a key inside a data component overrides only that key. The run itself is replaced."""
    import importlib

    module = importlib.import_module(f"qkvflow.cli.{verb}")
    cls = module.FinetuneConfig if verb == "finetune" else module.TrainConfig
    seen = []

    def run(config: cls):  # levanter.config.main parses into the annotated class
        seen.append(config)
        return {"status": "done"}

    monkeypatch.setattr(module, "_run", run)
    path = str(ROOT / config)
    assert cli(capsys, verb, "--config_path", path)[0] == 0
    assert cli(capsys, verb, "--config_path", path, "--verbose")[0] == 0
    assert (
        cli(
            capsys,
            verb,
            "--config_path",
            path,
            "--verbose",
            "--trainer.id",
            "v",
            "--data.components.c.cache_dir",
            "/fast/c",
        )[0]
        == 0
    )
    assert cli(capsys, verb, "--verbose", "false", "--config_path", path)[0] == 0
    assert [c.verbose for c in seen] == [False, True, True, False]
    assert seen[2].trainer.id == "v" and seen[2].data.components["c"].cache_dir == "/fast/c"
    if verb == "train":  # the YAML's component keeps its source
        assert seen[3].data.components.keys() == {"owt"}
        owt = seen[2].data.components
        assert owt.keys() == {"owt", "c"} and owt["owt"].source.id == "Skylion007/openwebtext"


# --- one way to parse a config (qkvflow.cli.parse) ------------------------------------------------------


@pytest.mark.parametrize("verb", ["train", "finetune", "describe", "sweep", "export", "analyze"])
def test_every_config_verb_parses_through_cli_parse(capsys, monkeypatch, tmp_path, verb):
    """Each verb reads its config with qkvflow.runs.configfile.parse (--config_path, overrides, draccus) and no other
    way: with parse replaced by a sentinel, each verb's main, given a valid config, stops at it."""
    import importlib

    import qkvflow.runs.configfile

    class Sentinel(Exception):
        pass

    calls = []

    def sentinel(cls, argv, verb_name, **kwargs):
        calls.append((cls.__name__, list(argv), verb_name))
        raise Sentinel

    monkeypatch.setattr(qkvflow.runs.configfile, "parse", sentinel)
    config = ROOT / (
        "configs/finetune/quickstart_lora.yaml" if verb in ("finetune", "sweep") else "configs/quickstart.yaml"
    )
    args = {
        "export": ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")],
        "analyze": ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")],
        "sweep": ["--depths", "2"],
    }.get(verb, [])
    first = ["spectra"] if verb == "analyze" else []
    argv = [*first, "--config_path", str(config), *args, "--trainer.id", "sentinel"]
    module = importlib.import_module(f"qkvflow.cli.{verb}")
    with pytest.raises(Sentinel):
        module.main(argv)
    assert len(calls) == 1
    _, parsed_argv, verb_name = calls[0]
    assert verb_name == verb and str(config) in parsed_argv and parsed_argv[-2:] == ["--trainer.id", "sentinel"]
    assert "--depths" not in parsed_argv  # sweep's own options are split off first


def test_parse_reads_the_config_path_in_both_forms_and_applies_the_overrides(tmp_path):
    from qkvflow.cli import parse
    from qkvflow.runs.config import TrainConfig

    path = str(ROOT / "configs/quickstart.yaml")
    forms = (["--config_path", path], [f"--config_path={path}"], ["--config_path", path[: -len(".yaml")]],
             ["--config_path", f"file://{path}"])  # a URL, copied locally as Levanter did  # fmt: skip
    for argv in forms:
        config = parse(TrainConfig, [*argv, "--verbose", "--data.components.c.cache_dir", "/fast/c"], "train")
        assert config.verbose is True and config.data.components["c"].cache_dir == "/fast/c"
        assert config.model.hidden_dim == 128  # from the file
    assert parse(TrainConfig, [], "train").verbose is False  # no --config_path: the defaults


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config_path"], "--config_path needs a value"),
        (["--config_path", "a.yaml", "--config_path=b.yaml"], "--config_path is given 2 times"),
    ],
)
def test_parse_refuses_a_config_path_without_value_or_twice(argv, message):
    from qkvflow.cli import parse
    from qkvflow.errors import UserError
    from qkvflow.runs.config import TrainConfig

    with pytest.raises(UserError, match=message):
        parse(TrainConfig, argv, "train")
