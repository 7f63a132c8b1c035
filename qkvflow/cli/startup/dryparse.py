"""Parse a `qkvflow ...` command line the way the verb does, and stop there: nothing is loaded, trained
or written.

`parse_only(["train", "--config_path", "configs/quickstart.yaml", "--trainer.num_train_steps", "20"])`
runs `qkvflow.cli.main` with the two seams every verb reads its arguments through stopped right after
they return:

* `qkvflow.runs.configfile.parse` (re-exported as `qkvflow.cli.parse`), how every config-driven verb reads
  its config file and `--dotted.key value` overrides with draccus;
* the verb's own `argparse` parser (`prog="qkvflow VERB ..."`: export, analyze, plan, every `bench`
  mode). When it leaves arguments over (`parse_known_args`), they are the overrides of a config read
  from the `--config_path` (the verb's option, or among the leftovers), as `export`, `analyze` and
  `plan` pass them on, and are parsed so (`LEFTOVER_CONFIG`).

Whatever the verb would refuse before that point (an unknown verb, a missing config file, a Levanter
1.2 key, an unknown model type) is refused as it would be, except that the files a command line names
(`--checkpoint`, `--files`: `qkvflow.cli.startup.early.PATHS`) need not exist. A renamed or removed flag, or a value of the wrong type, raises
`UserError` with the verb's own one-line message; the docs' command lines are checked with it
(tests/test_docs.py).
"""

import argparse
import contextlib
import io

from qkvflow import cli
from qkvflow.cli.startup import early
from qkvflow.errors import UserError
from qkvflow.plan.config import PlanConfig
from qkvflow.runs import configfile
from qkvflow.runs.config import TrainConfig

LEFTOVER_CONFIG = {"plan": PlanConfig}
"""The config class that a verb's argparse leftovers are parsed into, where it is not the training config
(export and analyze: `TrainConfig`; `plan` adds its own keys to it)."""


def _leftover_config(verb: str) -> type:
    return LEFTOVER_CONFIG.get(verb, TrainConfig)


class Parsed(BaseException):
    """Raised by the stopped seams to carry the parse out of the verb (a BaseException, so that no
    `except Exception` on the way up takes it for a failure)."""

    def __init__(self, value):
        super().__init__("parsed")
        self.value = value


def parse_only(argv: list[str]):
    """What the verb `argv[0]` parses from `argv[1:]`: a config dataclass or an argparse Namespace,
    or None for a command that only prints (`--help`). Raises UserError with the verb's message when
    the verb would refuse the command line."""
    verb = argv[0] if argv else ""
    err, out = io.StringIO(), io.StringIO()
    try:
        with _stopped_seams(verb), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            status = cli.main(list(argv))
    except Parsed as parsed:
        return parsed.value
    except SystemExit as e:  # argparse's own --help
        if e.code:
            raise UserError(f"qkvflow {verb}: exit status {e.code}") from None
        return None
    if status:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise UserError(lines[-1] if lines else f"qkvflow {verb}: exit status {status}")
    return None


@contextlib.contextmanager
def _stopped_seams(verb: str):
    real_parse = configfile.parse
    real_exists = early.check_exists
    real_known = argparse.ArgumentParser.parse_known_args
    real_args = argparse.ArgumentParser.parse_args
    depth = [0]  # argparse calls nested in the verb's own (subparsers, parse_args -> parse_known_args)

    def parse(cls, argv, verb_name, **kwargs):
        if depth[0]:  # a config read while parsing another (a fine-tune's pretrained run's)
            return real_parse(cls, argv, verb_name, **kwargs)
        depth[0] += 1
        try:
            value = real_parse(cls, argv, verb_name, **kwargs)
        finally:
            depth[0] -= 1
        raise Parsed(value)

    def ours(parser) -> bool:
        return depth[0] == 0 and parser.prog.startswith("qkvflow ")

    def parse_args(self, args=None, namespace=None):
        if not ours(self):
            return real_args(self, args, namespace)
        depth[0] += 1
        try:
            value = real_args(self, args, namespace)
        finally:
            depth[0] -= 1
        raise Parsed(value)

    def parse_known_args(self, args=None, namespace=None):
        if not ours(self):
            return real_known(self, args, namespace)
        depth[0] += 1
        try:
            namespace, rest = real_known(self, args, namespace)
        finally:
            depth[0] -= 1
        path = getattr(namespace, "config_path", None)
        args = rest if path is None else [configfile.CONFIG_PATH, path, *rest]
        if path is None and configfile.split_config_path(rest)[0] is None:
            if rest:
                raise UserError(f"unrecognized arguments: {' '.join(rest)}")
            raise Parsed((namespace, None))
        depth[0] += 1
        try:
            config = real_parse(_leftover_config(verb), args, verb)
        finally:
            depth[0] -= 1
        raise Parsed((namespace, config))

    configfile.parse = parse  # the verbs call it through the module
    argparse.ArgumentParser.parse_known_args = parse_known_args
    argparse.ArgumentParser.parse_args = parse_args
    early.check_exists = lambda option, value: None  # a command line parses whatever its files
    try:
        yield
    finally:
        early.check_exists = real_exists
        configfile.parse = real_parse
        argparse.ArgumentParser.parse_known_args = real_known
        argparse.ArgumentParser.parse_args = real_args
