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

The loss is the run's own evaluation (qkvflow.evaluation.perplexity); without --steps, --solver or
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

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.evaluation import auto_steps
from qkvflow.training.config import TrainConfig
from qkvflow.training.finetune import FinetuneConfig, is_finetune_config

KIND = "eval_table"
TRAINING_ONLY = ("epochs", "stop_after", "log_every", "z_loss_weight", "nonfinite", "data_seed", "loss_curve")
"""TrainConfig options that evaluation does not read (hidden from --help)."""
FILES = ("depth.md", "depth.json", "depth.png")


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
    """Replace an earlier `qkvflow eval` output in --output."""
    tasks: Optional[str] = None
    """lm-evaluation-harness tasks, comma-separated (e.g. arc_easy,piqa), or paths of task YAML files."""
    max_examples: Optional[int] = None
    """lm-eval's `limit`: at most this many examples per task."""
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


AUTO_OPTIONS = ("--auto_grids", "--auto_tolerance", "--auto_split")
GRID_OPTIONS = ("--steps", "--solver", "--tolerances", "--adaptive_solver", *AUTO_OPTIONS)


def _output_rules(config: EvalConfig, config_path: Optional[str]) -> dict:
    protect = [("--checkpoint", config.checkpoint), ("--config_path", config_path)]
    if isinstance(config, FinetuneConfig):
        protect += [("pretrained.checkpoint", config.pretrained.checkpoint)]
    return {"kind": KIND, "key": "--output", "overwrite": config.overwrite, "protect": protect}


def check(config: EvalConfig, config_path: Optional[str]) -> None:
    """Bad options and outputs, before any work."""
    from qkvflow.training.run_model import newest_step

    if not config.checkpoint:
        raise UserError("--checkpoint is missing: expected the run's checkpoint folder (checkpoints/<run_id>)")
    newest_step(config.checkpoint, name="--checkpoint")  # also refuses a step with unreadable metadata, as train does
    if not isinstance(config, FinetuneConfig) and not is_ode(config.model):
        given = [f"--{k}" for k in ("steps", "solver", "tolerances") if getattr(config, k) is not None]
        if given:
            from qkvflow.models import registry

            kind = registry.type_name(config.model)
            raise UserError(
                f"{' and '.join(given)}: model.type={kind} has a fixed depth; solver grids apply to DiffEqFormer checkpoints"
            )
    check_auto(config)
    if config.per_sequence and config.tolerances is None:
        raise UserError(
            "--per_sequence: needs --tolerances (a fixed grid takes the same evaluations for every sequence)"
        )
    if config.output is not None:
        outputs.check_replaceable(config.output, **_output_rules(config, config_path))
        outputs.check_writable(config.output, "--output", beside=True)


def is_ode(model_config) -> bool:
    from qkvflow.models import registry

    return registry.is_ode(model_config)


def is_auto(config) -> bool:
    return isinstance(config.steps, str) and config.steps.strip() == "auto"


def check_auto(config) -> None:
    """The options of --steps auto (eval's and generate's): valid with it, refused without it."""
    given = [
        key
        for key, value, default in zip(
            AUTO_OPTIONS,
            (config.auto_grids, config.auto_tolerance, config.auto_split),
            (auto_steps.GRIDS, auto_steps.TOLERANCE, None),
        )
        if value != default
    ]
    if not is_auto(config):
        if given:
            raise UserError(f"{' and '.join(given)}: only with --steps auto (expected --steps auto, or no {given[0]})")
        return
    auto_steps.check_tolerance(config.auto_tolerance)
    if config.auto_split is not None:
        from qkvflow.data.corpora import EVAL_SPLITS

        if config.corpus is None:
            raise UserError(
                f"--auto_split {config.auto_split}: needs a corpus: section (its selection and test halves); "
                "with a data: section, choose on one validation set and evaluate --steps K on another"
            )
        if config.auto_split not in EVAL_SPLITS:
            raise UserError(f"--auto_split {config.auto_split!r} is invalid: expected one of {', '.join(EVAL_SPLITS)}")


def on_auto_split(config):
    """`config` (before `with_corpus`) with its corpus evaluated on --auto_split: the data --steps auto scores."""
    if config.auto_split is None:
        return config
    return dataclasses.replace(config, corpus=dataclasses.replace(config.corpus, eval_split=config.auto_split))


def points(config: EvalConfig):
    from qkvflow.evaluation.depth import grid_points, parse_list, parse_steps

    if is_auto(config):
        steps = auto_steps.candidates(config.auto_grids, config.model.ode.num_steps)
    else:
        steps = parse_steps(config.steps, config.model.ode.num_steps)
    solvers = parse_list(config.solver, "solver", str, "comma-separated solver names, e.g. euler,rk4")
    tolerances = parse_list(config.tolerances, "tolerances", float, "comma-separated positive numbers, e.g. 1e-2,1e-3")
    return grid_points(config.model.ode, steps, solvers, tolerances, config.adaptive_solver)


def evaluate(config: EvalConfig, config_path: Optional[str] = None) -> dict:
    """The rows of the table (and lm-eval's results with --tasks) as a dict."""
    from qkvflow.training.run_model import load_run_model
    from qkvflow.training.session import announce_corpus, with_corpus

    check(config, config_path)
    finetuned = isinstance(config, FinetuneConfig)
    grid = points(config) if not finetuned and is_ode(config.model) else None
    each = None
    if config.tasks is not None:
        from qkvflow.evaluation import harness

        harness.check_installed()
        task_spec = harness.task_spec(config.tasks)
        harness.preload(task_spec)
        lm_eval: list = []

        def each(row, m):  # the same model at the same grid through lm-eval: one run per row
            outputs = harness.run(m, config, task_spec, config.max_examples, log_samples=config.log_samples)
            lm_eval.append({k: row[k] for k in ("solver", "grid", "steps", "tolerance", "nfe", "trained")} | outputs)

    announce_corpus(config)
    chooser = with_corpus(on_auto_split(config)) if is_auto(config) and config.auto_split is not None else None
    config = with_corpus(config)
    model, hf_tokenizer = load_run_model(config, config.checkpoint)  # a finetune run's: discretised, LoRA merged
    result: dict = {
        "checkpoint": config.checkpoint,
        "config_path": config_path,
        "model_type": type(model.config).__name__,
    }
    if finetuned:
        result["finetune"] = config.finetune
    result["rows"], result["eval_examples"] = score_grids(config, model, grid, hf_tokenizer, each)
    if is_auto(config):
        scored = None
        if chooser is not None:  # the candidates scored on --auto_split, the table on corpus.eval_split
            scored, _ = score_grids(chooser, model, [p for p in grid if not p.adaptive], hf_tokenizer)
        result["auto"] = mark_auto(result["rows"], config.auto_tolerance, scored, config.auto_split)
    if config.tasks is not None:
        result["lm_eval"] = lm_eval
    return result


def score_grids(config, model, grid, hf_tokenizer, each=None) -> tuple[list[dict], int]:
    """(rows, examples): the loss of `model` at each `GridPoint` of `grid` (None: as loaded) on the
    validation data of `config` (a corpus already resolved), as the run's evaluation computes it;
    `each(row, model at that grid)` runs after each row."""
    import haliax as hax
    import haliax.partitioning

    from qkvflow.data import cache_lock
    from qkvflow.evaluation import depth, perplexity

    t = config.trainer
    if not cache_lock.build(config.data, "validation"):  # tokenized on the first evaluation of this data
        raise UserError("data has no validation set: expected validation_urls (or a corpus) in the data config")
    # Outside the mesh, as training builds it (qkvflow.training.loop.make_evaluator): inside it, Levanter's
    # tagged dataset commits its tag arrays to the mesh's devices, and its loader's host-side batching
    # (one-CPU mesh) then refuses them on any mesh of more than one device, or of a GPU.
    evaluator = perplexity.make_evaluator(config, model.config.max_Pos, config.data.the_tokenizer)
    with haliax.partitioning.set_mesh(t.device_mesh), hax.axis_mapping(t.parameter_axis_mapping):
        model = hax.shard(model, t.parameter_axis_mapping)  # onto the trainer's mesh, as training holds it
        counts = perplexity.count_targets(evaluator, hf_tokenizer)
        rows = []
        for point in grid or [None]:
            m = model if point is None else depth.with_ode(model, point.ode)
            try:
                scored = perplexity.evaluate(evaluator, m, counts)
            except Exception as e:  # noqa: BLE001 (diffrax's max_steps error comes as a runtime error)
                if point is not None and point.adaptive and "max_steps" in str(e):
                    raise UserError(
                        f"--tolerances {point.tolerance:g}: the adaptive solve needed more than model.ode.max_steps="
                        f"{point.ode.max_steps} steps; raise --model.ode.max_steps or loosen the tolerance"
                    ) from None
                raise
            row = {"solver": "-", "grid": f"{getattr(model.config, 'num_layers', '?')} layers", "steps": None,
                   "tolerance": None, "nfe": None, "nfe_min": None, "nfe_max": None, "trained": True}  # fmt: skip
            if point is not None:
                row.update(solver=point.ode.solver, grid=point.label, tolerance=point.tolerance,
                           steps=None if point.adaptive else point.ode.num_steps, trained=depth.same_solve(point.ode, config.model.ode))  # fmt: skip
                if point.adaptive:
                    row["nfe"], row["nfe_min"], row["nfe_max"] = depth.measured_evaluations(m, evaluator, t.mp)
                    if getattr(config, "per_sequence", False):
                        row["nfe_per_sequence"] = depth.distribution(depth.per_sequence_evaluations(m, evaluator, t.mp))
                else:
                    row["nfe"] = depth.fixed_evaluations(point.ode)
            row.update(scored.as_dict())
            rows.append(row)
            if each is not None:
                each(row, m)
    return rows, len(evaluator.dataset.as_sync_dataset())


def mark_auto(rows: list[dict], tolerance: float, scored: Optional[list[dict]] = None, split=None) -> dict:
    """`--steps auto`: chooses among `scored` (the same grids scored on `split`; default: the fixed-grid
    `rows` themselves), marks the chosen grid's row (`auto`), returns what was chosen and on what."""
    fixed = [r for r in rows if r["tolerance"] is None]
    candidates = fixed if scored is None else scored
    chosen, best = auto_steps.choose(candidates, tolerance)
    grid = lambda r: (r["solver"], r["steps"])  # noqa: E731
    for r in fixed:
        if grid(r) == grid(candidates[chosen]):
            r["auto"] = True
    keep = ("solver", "steps", "nfe", "loss")
    out = {
        "tolerance": tolerance,
        "split": split,
        "chosen": {k: candidates[chosen][k] for k in keep},
        "best": {k: candidates[best][k] for k in keep},
        "summary": auto_steps.summary(candidates, chosen, best, tolerance, split),
    }
    if scored is not None:
        out["scores"] = [{k: r[k] for k in keep} for r in scored]
    return out


def write(result: dict, config: EvalConfig, config_path: Optional[str]) -> list[str]:
    from qkvflow.evaluation import depth

    with outputs.replacing(config.output, **_output_rules(config, config_path)) as folder:
        with open(os.path.join(folder, "depth.md"), "w") as f:
            f.write(depth.markdown_table(result["rows"]) + "\n")
            if "auto" in result:
                f.write("\n" + result["auto"]["summary"] + "\n")
            if config.per_sequence:
                f.write("\n" + depth.per_sequence_table(result["rows"]) + "\n")
        with open(os.path.join(folder, "depth.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        title = f"{os.path.basename(os.path.normpath(config.checkpoint))}: depth at inference"
        depth.plot(result["rows"], os.path.join(folder, "depth.png"), title=title)
    return [os.path.join(config.output, name) for name in FILES]


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


def read_config(argv: list[str]):
    """EvalConfig for a `qkvflow train` config, FinetuneEvalConfig for a `qkvflow finetune` one (as
    `qkvflow generate` tells them apart: a `pretrained:` section)."""
    from qkvflow import cli

    config_path, _ = cli.split_config_path(argv)
    cls = EvalConfig
    if is_finetune_config(config_path):
        refuse_grids(argv, config_path)
        cls = FinetuneEvalConfig
    return cli.parse(cls, argv, "eval", required="the run's `qkvflow train` or `qkvflow finetune` config")


def quiet_logging(verbose: bool = False) -> None:
    """The terminal shows qkvflow's warnings and everyone's errors, as in `qkvflow train` (Levanter's
    restore and data loader warn about things that are expected here)."""
    import logging

    from qkvflow.training.session import quiet_console

    logging.basicConfig(level=logging.INFO)
    quiet_console(verbose)


def main(argv: list[str]) -> int:
    from qkvflow import cli
    from qkvflow.cli import usage
    from qkvflow.evaluation import depth

    if usage.wants_help(argv):
        print(usage.short_help("qkvflow eval", EvalConfig, __doc__.split("\n\n")[0], hide=TRAINING_ONLY))
        return 0
    config_path, _ = cli.split_config_path(argv)
    config = read_config(usage.full_listing_args(argv))
    quiet_logging(config.verbose)
    result = evaluate(config, config_path)
    print(depth.markdown_table(result["rows"]))
    if "auto" in result:
        print(result["auto"]["summary"])
    if config.per_sequence:
        print(depth.per_sequence_table(result["rows"]))
    if "lm_eval" in result:
        from qkvflow.evaluation import harness

        print(harness.summary_table(result["lm_eval"]))
    if config.output is not None:
        for path in write(result, config, config_path):
            print(f"wrote {path}")
    return 0
