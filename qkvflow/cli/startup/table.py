"""What the command line answers before the verbs' stack is imported, written down: `table.json`.

`qkvflow.cli.startup.early` answers `--help` and refuses unknown model types without importing JAX, Levanter,
transformers or draccus, so it cannot ask the verbs or the model registry. It reads this table instead:

* `help`: the exact text each command's `--help` prints (every verb, every `bench` mode and `analyze`
  analysis, and the `bench` and `analyze` overviews), rendered by the verbs' own code at a fixed width
  of `COLUMNS` characters (argparse otherwise follows the terminal's);
* `model_types`: every `model.type` draccus accepts (`LmConfig`'s registered choices, qkvflow's
  families and Levanter's models);
* `keys`: the top-level keys of the config each draccus-parsed verb reads (`CONFIGS`; `eval finetune`
  and `generate finetune` for a `qkvflow finetune` config).

`python -m qkvflow.cli.startup.table` rewrites the file; tests/test_cli_early.py fails, naming that command,
whenever the table differs from what the code renders now (a changed docstring, option or model type).
This module imports the whole stack: only that test and the command above import it.
"""

import contextlib
import dataclasses
import importlib
import io
import json
import os
import sys
from pathlib import Path

from levanter.models.lm_model import LmConfig

import qkvflow.models  # noqa: F401  (registers qkvflow's model families)
from qkvflow.cli import VERBS, analyze, bench, describe, eval, generate, tokenizer
from qkvflow.finetune.run import FinetuneConfig
from qkvflow.runs.config import TrainConfig

PATH = Path(__file__).with_name("table.json")
COLUMNS = 100
"""The width argparse wraps help at while the table is rendered."""


def commands() -> list[list[str]]:
    """Every command with a `--help` of its own: each verb, `bench MODE` and `analyze ANALYSIS`."""
    out = [[verb] for verb in VERBS]
    out += [["bench", mode] for mode in bench.MODES]
    out += [["analyze", name] for name in analyze.ANALYSES]
    return out


def render_help(command: list[str]) -> str:
    """What `qkvflow COMMAND --help` prints, from the verb's own module."""
    module = importlib.import_module(VERBS[command[0]][0])
    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(COLUMNS)
    try:
        with contextlib.redirect_stdout(out):
            try:
                module.main([*command[1:], "--help"])
            except SystemExit as e:  # argparse's verbs exit after printing
                assert not e.code, f"{' '.join(command)} --help exited with {e.code}"
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue()


def model_types() -> list[str]:
    return sorted(LmConfig.get_known_choices())


def configs() -> dict:
    """The config class each draccus-parsed verb reads its whole command line into (a verb with argparse
    options of its own, export, analyze, plan and bench, is left out)."""
    return {
        "train": TrainConfig,
        "describe": describe.DescribeConfig,
        "eval": eval.EvalConfig,
        "eval finetune": eval.FinetuneEvalConfig,
        "generate": generate.GenerateConfig,
        "generate finetune": generate.FinetuneGenerateConfig,
        "finetune": FinetuneConfig,
        "sweep": FinetuneConfig,
        "tokenizer": tokenizer.TokenizerConfig,
    }


def render() -> dict:
    return {
        "help": {" ".join(c): render_help(c) for c in commands()},
        "model_types": model_types(),
        "keys": {verb: sorted(f.name for f in dataclasses.fields(cls)) for verb, cls in configs().items()},
    }


def dumps(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def stale(written: dict, now: dict) -> list[str]:
    """What differs between the table as written and as rendered now: help commands, `model_types`."""
    out = [f"help of `qkvflow {c} --help`" for c in sorted(set(written["help"]) | set(now["help"]))
           if written["help"].get(c) != now["help"].get(c)]  # fmt: skip
    for key in ("model_types", "keys"):
        if written.get(key) != now[key]:
            out.append(f"{key} (now {json.dumps(now[key])})")
    return out


def main(argv: list[str]) -> int:
    """`python -m qkvflow.cli.startup.table`: rewrite table.json; with `--check`, say what is stale and exit 1."""
    now = render()
    if "--check" in argv:
        differ = stale(json.loads(PATH.read_text(encoding="utf-8")), now)
        for what in differ:
            print(f"{PATH.name} is stale: {what}; run `python -m qkvflow.cli.startup.table`", file=sys.stderr)
        return 1 if differ else 0
    PATH.write_text(dumps(now), encoding="utf-8")
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
