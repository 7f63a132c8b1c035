"""`qkvflow VERB ...`: a thin dispatcher; each verb is its own module, `qkvflow/cli/<verb>.py`.

Bad input (unknown or mistyped config keys, unreadable YAML, missing files, invalid values) ends
with one line naming the problem and exit status 2, not a traceback. Ctrl-C ends every verb with one
line and exit status 130 (qkvflow.cli.startup.interrupt).

The start-up seam, the command line's one place of lazy imports. A verb's module imports its stack
(JAX, Levanter, draccus, transformers) at its top, which costs seconds; `--help` and a mistyped
argument should not wait for that. So `main` answers `qkvflow --help` and `--version`, and
`qkvflow.cli.startup.early.check` answers `VERB --help` and refuses what argv and the config file alone
decide (the --config_path file, Levanter 1.2 keys, model types, paths, grids, outputs), importing only
what this module and `early` import at their top (the standard library, PyYAML, light qkvflow modules).
Only then does `_verb` import draccus and the verb's module (`importlib.import_module(VERBS[verb][0])`;
`qkvflow bench` imports its mode's module the same way, qkvflow.cli.bench.MODES).
The other lazy imports are in qkvflow.cli.startup.usage, which `early` imports: the model registry and
draccus's docstring reader, which only a verb's own `--help` needs.
tests/test_cli_early.py checks that none of JAX, Levanter, transformers, draccus or NumPy is imported
on that path.

Each verb reads its config with `qkvflow.runs.configfile.parse` (the --config_path file and the
overrides, two kinds of which draccus cannot read are rewritten by `overrides`), and nothing else;
what the verbs share besides is in qkvflow.cli.startup (usage, console).
"""

import argparse
import contextlib
import gc
import importlib
import sys

import yaml

from qkvflow import __version__
from qkvflow.cli.bench import MODES as BENCH_MODES
from qkvflow.cli.startup import early, interrupt
from qkvflow.errors import UserError
from qkvflow.runs.configfile import _user_cause, blamed_flag, overrides, parse  # noqa: F401  (re-exported: `qkvflow.cli.parse` is how scripts read a config)

VERBS = {
    "train": ("qkvflow.cli.train", "train a model with Levanter (--config_path CFG [--key value ...])"),
    "describe": ("qkvflow.cli.describe", "parameter counts and FLOPs of a config, as JSON"),
    "analyze": ("qkvflow.cli.analyze", "spectra | lyapunov | clusters: the paper's analyses, figures and JSON"),
    "export": ("qkvflow.cli.export", "a DiffEqFormer checkpoint as a Hugging Face model (--steps M layers) [+ --ode]"),
    "bench": (
        "qkvflow.cli.bench",
        f"{' | '.join(BENCH_MODES)}: throughput, memory, quality, paired comparisons, early exits, merged depth curves",
    ),
    "finetune": (
        "qkvflow.cli.finetune",
        "discretise a pretrained ODE model at M layers and fine-tune it (LoRA or full)",
    ),
    "eval": (
        "qkvflow.cli.eval",
        "perplexity and bits per byte of a checkpoint at any solver grid (--steps 2,4); lm-eval --tasks",
    ),
    "generate": (
        "qkvflow.cli.generate",
        "text from a train or finetune checkpoint, KV-cached on Levanter's inference engine",
    ),
    "tokenizer": (
        "qkvflow.cli.tokenizer",
        "train a tokenizer on your own .txt/.jsonl files, offline (--files ... --output DIR)",
    ),
    "plan": ("qkvflow.cli.plan", "compile the training step for absent GPUs/TPUs: memory, kernels, roofline"),
    "sweep": (
        "qkvflow.cli.sweep",
        "fine-tune over a grid of depths x methods; table and figure (--depths 9,12 --methods lora,full)",
    ),
}


def overview() -> str:
    lines = ["usage: qkvflow VERB [--config_path CFG] [--dotted.key value ...]", "", "verbs:"]
    lines += [f"  {verb:<10} {help}" for verb, (_, help) in VERBS.items()]
    return "\n".join(lines)


@contextlib.contextmanager
def _argparse_raises():
    """Make argparse's errors (unknown override keys) exceptions instead of a page of usage."""

    def error(self, message):
        raise UserError(f"{message} (`qkvflow VERB --help` lists the keys)")

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def _config_path(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--config_path="):
            return arg.split("=", 1)[1]
        if arg == "--config_path" and i + 1 < len(argv):
            return argv[i + 1]
    return "the config"


def _unreadable_value(args: list[str]) -> tuple[str, str] | None:
    """The first `--key value` (or `--key=value`) of the command line whose value is not YAML."""
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg.partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                continue
            value = args[i + 1]
        try:
            yaml.safe_load(value)
        except yaml.YAMLError:
            return key, value
    return None


GC_THRESHOLDS = (20_000, 20, 20)
"""The garbage collector's thresholds in a `qkvflow` process (Python's defaults: 700, 10, 10)."""


def collect_less() -> None:
    """Run Python's cyclic garbage collector less often: a process spends its first minute importing
    and tracing (JAX builds millions of short-lived Python objects, which reference counting frees), and
    at the default thresholds the collector ran 1,665 times in a tiny 8-step training run and took 2.8 s
    of its 20 s, 0.8 s at these (`python benchmarks/gc_time.py [--thresholds 700,10,10] -m qkvflow train
    --config_path tests/configs/tiny_train.yaml ...`, 2026-11-28; benchmarks/README.md). Cycles are still
    collected, after 20,000 allocations instead of 700."""
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    collect_less()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(overview())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"qkvflow {__version__}")
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        hint = early.did_you_mean(verb, VERBS)
        print(f"qkvflow: error: unknown verb {verb!r}: expected one of {', '.join(VERBS)}{hint}", file=sys.stderr)
        return 2
    with interrupt.at_once(verb) if verb in interrupt.AT_ONCE else contextlib.nullcontext():
        try:
            return _verb(verb, rest)
        except KeyboardInterrupt:
            print(interrupt.line(verb), file=sys.stderr)
            return interrupt.STATUS


def _verb(verb: str, rest: list[str]) -> int:
    where = _config_path(rest)
    try:
        if early.check(verb, rest):  # before anything heavy is imported
            return 0
    except UserError as e:
        return _refused(verb, str(e))
    except yaml.YAMLError as e:  # an override's value (qkvflow.runs.configfile.overrides reads some as YAML)
        return _refused(verb, _not_yaml(e, rest, where))

    import draccus.utils  # lazy: the stack, only after the early checks (the start-up seam above)

    try:
        with _argparse_raises():
            module = importlib.import_module(VERBS[verb][0])
            return module.main(rest) or 0
    except UserError as e:
        message = str(e)
    except (draccus.utils.DecodingError, draccus.utils.ParsingError) as e:
        cause = _user_cause(e)
        flag = blamed_flag(e, rest)
        if flag is not None:  # a value given on the command line, not in the config file
            what = cause if cause is not None else e if isinstance(e, draccus.utils.DecodingError) else e.__cause__ or e
            message = f"command line ({flag}): {what}"
        elif cause is not None:
            message = f"{where}: {cause}"
        elif isinstance(e, draccus.utils.DecodingError):
            message = f"{where}: {e}"
        elif isinstance(e.__cause__, draccus.utils.DecodingError):
            message = f"{where}: {e.__cause__}"
        else:
            message = f"{where} is not valid YAML: {e.__cause__ or e}".replace("\n", " ")
    except yaml.YAMLError as e:  # a command-line value draccus reads as YAML (the file's errors are draccus's)
        message = _not_yaml(e, rest, where)
    except FileNotFoundError as e:
        message = str(e)
    return _refused(verb, message)


def _not_yaml(error, rest: list[str], where: str) -> str:
    flag, value = _unreadable_value(rest) or ("", None)
    problem = getattr(error, "problem", None) or error
    return f"command line ({flag}): {value!r} is not valid YAML: {problem}" if flag else f"{where}: {error}"


def _refused(verb: str, message: str) -> int:
    message = " ".join(line.strip() for line in message.splitlines() if line.strip())  # one line
    print(f"qkvflow {verb}: error: {message}", file=sys.stderr)
    return 2
