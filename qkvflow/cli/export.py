"""`qkvflow export`: a trained DiffEqFormer as a Hugging Face model (and optionally as an ODE export).

    qkvflow export --checkpoint DIR --config_path CFG [--steps M] --output OUT [--overwrite] [--solver euler] [--ode]

Discretises the ODE model into M parallel blocks (`qkvflow.models.discretise`; M defaults to the config's
ode.num_steps N, where the export computes exactly the model's Euler solve; `--steps` takes an integer or,
as `qkvflow eval` does, a multiple of N such as 2N or N/2) and writes OUT as a
transformers folder (`qkvflow.export.hf_folder`) with the run's tokenizer. `--ode` also writes the full
ODE model to OUT/ode (`qkvflow.export.ode`). Further `--dotted.key value` arguments override the
config as in `qkvflow train` (e.g. `--corpus.root`). Prints a JSON summary. See docs/export.md.
This module parses and checks the command line; the export itself is qkvflow.export.run.

OUT is written into a temporary sibling and swapped in when complete (`qkvflow.outputs`); it must
be absent, empty, or (with --overwrite) an earlier export holding only the files that export listed
in its `qkvflow_output.json`. The current folder, its ancestors, the home folder and any folder
holding the checkpoint or the config are never replaced, and nothing is written inside the
checkpoint's run folder (checkpoints/<run_id>, its step-N folders included).
"""

import argparse
import json

from qkvflow import outputs
from qkvflow.cli.startup import usage
from qkvflow.cli.startup.console import quiet_checkpoint_warnings
from qkvflow.errors import UserError
from qkvflow.evaluation.depth import parse_steps
from qkvflow.evaluation.grids import ONE_DEPTH
from qkvflow.export.run import export_checkpoint
from qkvflow.models import registry
from qkvflow.models.discretise import SOLVERS
from qkvflow.runs import configfile
from qkvflow.runs import model as run_model
from qkvflow.runs.config import TrainConfig

KIND = "hf_export"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkvflow export", description=__doc__.split("\n\n")[0], epilog=usage.footer("export")
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoints/<run_id> or one of its step-N folders")
    parser.add_argument("--config_path", required=True, help="the run's training config (YAML)")
    parser.add_argument(
        "--output", required=True, help="folder to write (absent, empty, or an earlier export with --overwrite)"
    )
    parser.add_argument(
        "--steps",
        default=None,
        help="M, the number of layers: an integer, or relative to the trained N = ode.num_steps as eval and "
        "generate take it (2N, N/2; default: N)",
    )
    parser.add_argument("--solver", default="euler", help="discretisation: euler (the only one that maps to blocks)")
    parser.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    parser.add_argument("--ode", action="store_true", help="also write the full ODE model to OUTPUT/ode")
    return parser


def _output_rules(args) -> dict:
    """How --output may be replaced (qkvflow.outputs): never the checkpoint or the config it reads, and
    never inside the checkpoint's run folder."""
    protect = [("--checkpoint", args.checkpoint), ("--config_path", args.config_path)]
    outside = [("the run folder of --checkpoint", run_model.run_folder(args.checkpoint))]
    return {"kind": KIND, "key": "--output", "overwrite": args.overwrite, "protect": protect, "outside": outside}


def check_output(args) -> None:
    """Refuse an --output that cannot be written or must not be replaced, before any work."""
    outputs.check_replaceable(args.output, **_output_rules(args))
    outputs.check_writable(args.output, "--output", beside=True)


def _train_config(path: str, overrides: list[str]):
    config = configfile.parse(TrainConfig, [configfile.CONFIG_PATH, path, *overrides], "export")
    if not registry.is_ode(config.model):
        kind = registry.type_name(config.model)
        raise UserError(f"{path}: export needs a DiffEqFormer checkpoint; got model.type={kind}")
    return config


def layers(text, trained: int) -> int:
    """--steps as export takes it: M, an integer or a multiple of the trained N (`qkvflow eval`'s forms,
    qkvflow.evaluation.depth.parse_steps), one value; default N."""
    if text is None:
        return trained
    if str(text).strip() == "auto":  # the choice needs validation data and options of its own: eval makes it
        raise UserError(
            "export: --steps auto is not taken: export writes one depth M; choose it with `qkvflow eval "
            "--steps auto` (its marked grid N') and pass that N' as --steps"
        )
    if str(text).strip().lstrip("+-").isdigit() and int(text) < 1:
        raise UserError(f"export: --steps {text} is invalid: expected an integer >= 1 (the number of layers)")
    steps = parse_steps(text, trained, expected=ONE_DEPTH)
    if len(steps) != 1:
        raise UserError(f"--steps {text!r} is invalid: expected {ONE_DEPTH}")
    return steps[0]


def export(args, overrides: list[str]) -> dict:
    if args.solver not in SOLVERS:
        raise UserError(f"export: --solver {args.solver} is invalid: expected one of {list(SOLVERS)}")
    check_output(args)
    config = _train_config(args.config_path, overrides)
    steps = layers(args.steps, config.model.ode.num_steps)

    quiet_checkpoint_warnings()
    rules = _output_rules(args)
    return export_checkpoint(config, args.checkpoint, args.output, steps, args.solver, ode=args.ode, rules=rules)


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    print(json.dumps(export(args, overrides), indent=2))
    return 0
