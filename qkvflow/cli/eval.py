"""`qkvflow eval`: perplexity and bits per byte of a checkpoint, at any solver grid; lm-eval tasks.

    qkvflow eval --config_path CFG --checkpoint CKPT [--steps 2,4,8 | --steps auto] [--solver euler,rk4]
                 [--tolerances 1e-2,1e-3 [--adaptive_solver tsit5]] [--output DIR [--overwrite]]
                 [--tasks T1,T2 [--max_examples K]] [--dotted.key value ...]

CFG is the run's `qkvflow train` config (any model type: a DiffEqFormer, or Levanter's GPT-2/Llama
baseline) or `qkvflow finetune` config (LoRA or full: the discretised M-layer model with its
fine-tuned parameters, LoRA merged, loaded as `qkvflow generate` loads it) and CKPT its checkpoint
folder (checkpoints/<run_id>, newest step, or a step-N folder).
Every other `--dotted.key value` overrides CFG as in `qkvflow train`: another validation set is
`--data.components.NAME.source.validation_urls '[...]'` (or a whole `--data '{...}'`), all of it rather
than the run's `trainer.max_eval_batches` cap is `--trainer.max_eval_batches null`.

This module parses and dispatches; the work is qkvflow.evaluation.evaluate. The loss is the run's own
evaluation (qkvflow.evaluation.perplexity); without --steps, --solver or
--tolerances it is the model at its config's grid, and equals the run's last `eval/loss`. For a
DiffEqFormer, --steps/--solver/--tolerances evaluate the same parameters at each grid
(qkvflow.evaluation.depth); a baseline or a fine-tuned model has a fixed depth and refuses them.
`--steps auto` evaluates the grids of --auto_grids (default N/4,N/2,N,2N,4N; each --solver) and marks
the one with the fewest vector-field evaluations whose loss is within --auto_tolerance nats (default
0.01) of the lowest (qkvflow.evaluation.auto_steps; --tolerances rows are shown, not candidates).
With a corpus, `--auto_split selection` makes that choice on the selection half and the table reports
every grid on corpus.eval_split (e.g. `--corpus.eval_split test`). `qkvflow generate --steps auto`
decodes on the grid chosen that way. The table is printed; with
--output it is also written as depth.md and depth.json, with the plot depth.png (perplexity against
vector-field evaluations), into DIR (qkvflow.outputs: an absent or empty folder, or an earlier
`qkvflow eval` output with --overwrite). --tasks runs lm-evaluation-harness tasks through Levanter's
harness (qkvflow.evaluation.harness; `pip install 'qkvflow[eval]'`) on the model of every row: at
each grid of --steps/--solver/--tolerances, printed as a second table with one row per grid, task and
metric (`lm_eval` in depth.json, a list in the order of the rows). --per_sequence adds, for every
--tolerances row, the distribution (mean, min, 10/50/90% quantiles, max) of the vector-field
evaluations of each sequence solved alone (`nfe_per_sequence`; qkvflow.evaluation.depth).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from qkvflow.cli.startup import usage
from qkvflow.errors import UserError
from qkvflow.evaluation import auto_steps, depth, harness
from qkvflow.evaluation.evaluate import evaluate, write
from qkvflow.runs import configfile
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.finetune_config import FinetuneConfig, is_finetune_config
from qkvflow.training.session import quiet_console

TRAINING_ONLY = ("epochs", "stop_after", "log_every", "z_loss_weight", "nonfinite", "data_seed", "loss_curve")
"""TrainConfig options that evaluation does not read (hidden from --help)."""


@dataclass
class EvalOptions:
    checkpoint: Optional[str] = None
    """The run's checkpoints: checkpoints/<run_id> (its newest step-N) or a step-N folder."""
    steps: Optional[str] = None
    """Fixed solver grids to evaluate a DiffEqFormer at, comma-separated (e.g. 1,2,4,8,16, or relative to the trained
    N = model.ode.num_steps: N/4,N/2,N,2N,4N), or auto (the grids of --auto_grids, the cheapest within
    --auto_tolerance of the best marked); default: model.ode.num_steps."""
    auto_grids: str = auto_steps.GRIDS
    """With --steps auto: the candidate grids, as --steps takes them."""
    auto_tolerance: float = auto_steps.TOLERANCE
    """With --steps auto: nats per token above the lowest candidate loss that the chosen grid may lose."""
    auto_split: Optional[str] = None
    """With --steps auto and a corpus: choose on this split (selection, test or validation), report on corpus.eval_split."""
    solver: Optional[str] = None
    """Solvers for the fixed grids, comma-separated (euler, heun, midpoint, ralston, rk4, tsit5, dopri5); default: model.ode.solver."""
    tolerances: Optional[str] = None
    """Adaptive solves at these relative tolerances, comma-separated (e.g. 1e-2,1e-3); atol keeps the config's atol/rtol ratio."""
    adaptive_solver: str = "tsit5"
    """Solver of the --tolerances rows: one with an error estimate (heun, midpoint, ralston, tsit5, dopri5)."""
    output: Optional[str] = None
    """Folder for depth.md, depth.json and depth.png (absent, empty, or an earlier `qkvflow eval` output with --overwrite)."""
    overwrite: bool = False
    """Replace an existing output file or an earlier qkvflow output folder (refused without it)."""
    tasks: Optional[str] = None
    """lm-evaluation-harness tasks, comma-separated (e.g. arc_easy,piqa), or paths of task YAML files."""
    max_examples: Optional[int] = None
    """lm-eval's `limit`: at most this many examples per task (an integer >= 1; with --tasks)."""
    log_samples: bool = False
    """With --tasks and --output: also keep lm-eval's per-document requests and scores (`samples` in depth.json)."""
    per_sequence: bool = False
    """With --tolerances: also solve every sequence alone (vmap) and report the distribution of its vector-field evaluations."""


@dataclass
class EvalConfig(TrainConfig, EvalOptions):
    """A training config plus the evaluation options."""


@dataclass
class FinetuneEvalConfig(FinetuneConfig, EvalOptions):
    """A fine-tuning config plus the evaluation options. `steps` and `solver` are the fine-tuning
    config's (the depth M and the discretisation of the model it trained): a fine-tuned checkpoint is
    a parallel transformer of fixed depth, so the solver grids do not apply (`refuse_grids`)."""


GRID_OPTIONS = ("--steps", "--solver", "--tolerances", "--adaptive_solver", *auto_steps.OPTIONS)


def refuse_grids(argv: list[str], config_path: Optional[str]) -> None:
    """A `qkvflow finetune` checkpoint is a discretised model of fixed depth (its config's `steps: M`
    layers); there `steps` and `solver` are the fine-tuning config's own keys, so --steps/--solver
    would silently rebuild another model instead of choosing a grid: one line instead."""
    given = [key for key in GRID_OPTIONS if any(a == key or a.startswith(key + "=") for a in argv)]
    if given:
        raise UserError(
            f"{' and '.join(given)}: {config_path} is a `qkvflow finetune` config, whose checkpoint is a discretised "
            "model of fixed depth (its `steps: M` layers); solver grids apply to DiffEqFormer checkpoints of `qkvflow train`"
        )


def refuse_empty_tasks(argv: list[str]) -> None:
    """`--tasks ","` (or `a,,b`): the list's own message, before the config parser reads "," as YAML."""
    for i, arg in enumerate(argv):
        if arg.startswith("--tasks="):
            harness.task_names(arg.split("=", 1)[1])
        elif arg == "--tasks" and i + 1 < len(argv):
            harness.task_names(argv[i + 1])


def read_config(argv: list[str]):
    """EvalConfig for a `qkvflow train` config, FinetuneEvalConfig for a `qkvflow finetune` one (as
    `qkvflow generate` tells them apart: a `pretrained:` section)."""
    config_path, _ = configfile.split_config_path(argv)
    refuse_empty_tasks(argv)
    cls = EvalConfig
    if is_finetune_config(config_path):
        refuse_grids(argv, config_path)
        cls = FinetuneEvalConfig
    return configfile.parse(cls, argv, "eval", required="the run's `qkvflow train` or `qkvflow finetune` config")


def quiet_logging(verbose: bool = False) -> None:
    """The terminal shows qkvflow's warnings and everyone's errors, as in `qkvflow train` (Levanter's
    restore and data loader warn about things that are expected here)."""
    logging.basicConfig(level=logging.INFO)
    quiet_console(verbose)


def main(argv: list[str]) -> int:
    if usage.wants_help(argv):
        print(usage.short_help("qkvflow eval", EvalConfig, __doc__.split("\n\n")[0], hide=TRAINING_ONLY))
        return 0
    config_path, _ = configfile.split_config_path(argv)
    config = read_config(usage.full_listing_args(argv))
    quiet_logging(config.verbose)
    result = evaluate(config, config_path)
    print(depth.markdown_table(result["rows"]))
    if "auto" in result:
        print(result["auto"]["summary"])
    if config.per_sequence:
        print(depth.per_sequence_table(result["rows"]))
    if "lm_eval" in result:
        print(harness.summary_table(result["lm_eval"]))
    if config.output is not None:
        for path in write(result, config, config_path):
            print(f"wrote {path}")
    return 0
