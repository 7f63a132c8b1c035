"""`qkvflow analyze ANALYSIS ...`: the paper's analyses of a trained model (qkvflow.analysis).

    qkvflow analyze spectra  --config_path CFG --checkpoint DIR [--num_times 64 | --at_solver_times] [--output DIR]
    qkvflow analyze lyapunov --config_path CFG --checkpoint DIR --text "..." [--steps N] [--output DIR]
    qkvflow analyze clusters [--seed 0] [--output DIR]                            (each: [--overwrite])

Further `--dotted.key value` arguments override the config as in `qkvflow train` (for example
`--corpus.root`). Each analysis writes PNG figures (and for lyapunov an HTML page) under --output
and prints a JSON summary with the numbers and the paths written. --output follows the rules of
every other verb's output folder (qkvflow.outputs): it is written whole and swapped in at the end,
and only an absent or empty folder or (with --overwrite) an earlier output of the same analysis is
replaced. Bad input raises UserError, which the CLI prints as one line.
"""

import argparse
import json
import os

import qkvflow.analysis.clusters
from qkvflow import outputs
from qkvflow.analysis.lyapunov import analyze_lyapunov, encode_prompt
from qkvflow.analysis.spectra import analyze_spectra
from qkvflow.cli.startup import usage
from qkvflow.cli.startup.console import quiet_checkpoint_warnings
from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.runs import configfile
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.corpus import with_corpus
from qkvflow.runs.model import load_model

DEFAULT_OUTPUT = "runs/analysis/{analysis}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkvflow analyze", description=__doc__.split("\n\n")[0], epilog=usage.footer("analyze")
    )
    sub = parser.add_subparsers(dest="analysis", required=True, metavar="{spectra,lyapunov,clusters}")

    def add(name: str, help: str, *, model: bool) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        if model:
            p.add_argument("--config_path", required=True, help="the run's training config (YAML)")
            p.add_argument("--checkpoint", required=True, help="checkpoints/<run_id> or one of its step-N folders")
        p.add_argument("--output", default=None, help=f"folder for figures and JSON (default {DEFAULT_OUTPUT})")
        p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
        return p

    spectra = add("spectra", "eigenvalues of the QK and OV circuits along depth (Fig. 2a-b)", model=True)
    spectra.add_argument("--num_times", type=int, default=64, help="times t sampled in [0, 1] (ODE models)")
    spectra.add_argument(
        "--at_solver_times", action="store_true", help="sample only the times the model's fixed-grid solve uses"
    )
    lyapunov = add("lyapunov", "token sensitivity by Lyapunov exponents, attention maps (Fig. 3, app. F)", model=True)
    lyapunov.add_argument("--text", required=True, help="the input text; its last token is the target")
    lyapunov.add_argument("--steps", type=int, default=None, help="Euler steps (default: the model's ode.num_steps)")
    clusters = add("clusters", "attention-only particle system with time-scaled weights (app. C.8)", model=False)
    clusters.add_argument("--seed", type=int, default=0, help="seed of the initial token positions")
    return parser


def _train_config(path: str, overrides: list[str]):
    return configfile.parse(TrainConfig, [configfile.CONFIG_PATH, path, *overrides], "analyze")


def _require_ode_model(config, analysis: str, path: str) -> None:
    if not registry.is_ode(config.model):
        raise UserError(
            f"{analysis} needs an ODE model, whose weights are functions of t (type diffeqformer_* or "
            f"shared_ode_*); {path} describes Levanter's discrete {type(config.model).__name__}"
        )


def spectra(args, overrides: list[str]) -> dict:
    if args.num_times < 2:
        raise UserError(f"spectra: --num_times {args.num_times} is invalid: expected an integer >= 2")
    model, _ = load_model(_train_config(args.config_path, overrides), args.checkpoint)
    return analyze_spectra(model, args.output, num_times=args.num_times, at_solver_times=args.at_solver_times)


def lyapunov(args, overrides: list[str]) -> dict:
    config = _train_config(args.config_path, overrides)
    _require_ode_model(config, "lyapunov", args.config_path)
    if args.steps is not None and args.steps < 1:
        raise UserError(f"lyapunov: --steps {args.steps} is invalid: expected an integer >= 1")
    encode_prompt(with_corpus(config).data.the_tokenizer, args.text, config.model.max_seq_len)  # fail before loading
    model, tokenizer = load_model(config, args.checkpoint)
    return analyze_lyapunov(model, tokenizer, args.text, args.output, num_steps=args.steps)


def clusters(args, overrides: list[str]) -> dict:
    if overrides:
        raise UserError(f"clusters: unrecognized arguments: {' '.join(overrides)}")
    return qkvflow.analysis.clusters.analyze_clusters(args.output, seed=args.seed)


ANALYSES = {"spectra": spectra, "lyapunov": lyapunov, "clusters": clusters}


def _output_rules(args) -> dict:
    """How --output may be replaced: by an earlier output of the same analysis only, with --overwrite, never
    the checkpoint or config being read."""
    protect = [(f"--{k}", getattr(args, k, None)) for k in ("checkpoint", "config_path")]
    return {"kind": f"{args.analysis} analysis", "key": "--output", "overwrite": args.overwrite, "protect": protect}


def _moved(value, folder: str, output: str):
    """`value` (the analysis summary) with paths inside the temporary `folder` made paths in `output`."""
    if isinstance(value, dict):
        return {k: _moved(v, folder, output) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, folder, output) for v in value]
    if isinstance(value, str) and value.startswith(folder + os.sep):
        return os.path.join(output, os.path.relpath(value, folder))
    return value


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    if args.output is None:
        args.output = DEFAULT_OUTPUT.format(analysis=args.analysis)
    quiet_checkpoint_warnings()
    rules = _output_rules(args)
    outputs.check_replaceable(args.output, **rules)  # before loading a model or running an analysis
    outputs.check_writable(args.output, "--output", beside=True)
    with outputs.replacing(args.output, **rules) as folder:  # swapped in only when complete
        output, args.output = args.output, folder
        summary = _moved(ANALYSES[args.analysis](args, overrides), folder, output)
    print(json.dumps(summary, indent=2))
    return 0
