"""What `qkvflow eval` computes (the command, its options and its table are in qkvflow.cli.eval):
the loss of a run's model at each solver grid, on the run's validation data, as the run's own
evaluation computes it (`qkvflow.evaluation.perplexity`), with lm-evaluation-harness tasks per grid
(`qkvflow.evaluation.harness`) and the `--steps auto` choice (`qkvflow.evaluation.auto_steps`).

    check(config, config_path)           bad options and outputs, before any work
    points(config)                       the grids of --steps/--solver/--tolerances (or --auto_grids)
    evaluate(config, config_path)        the table's rows (and lm-eval's results) as a dict
    score_grids(config, model, grid, ..) the rows: one model, every grid (also what `generate --steps auto` scores)
    write(result, config, config_path)   depth.md, depth.json and depth.png into --output (qkvflow.outputs)
"""

from __future__ import annotations

import json
import os
from typing import Optional

from qkvflow import outputs
from qkvflow.data import cache_lock
from qkvflow.errors import UserError
from qkvflow.evaluation import auto_steps, depth, harness, perplexity
from qkvflow.evaluation.auto_steps import check_auto, is_auto, mark_auto, on_auto_split
from qkvflow.evaluation.grids import parse_list, parse_steps
from qkvflow.models import registry
from qkvflow.runs.corpus import announce_corpus, with_corpus
from qkvflow.runs.finetune_config import FinetuneConfig
from qkvflow.runs.model import load_run_model, newest_step, run_folder

KIND = "eval_table"
FILES = ("depth.md", "depth.json", "depth.png")


def _output_rules(config, config_path: Optional[str]) -> dict:
    protect = [("--checkpoint", config.checkpoint), ("--config_path", config_path)]
    outside = [("the run folder of --checkpoint", run_folder(config.checkpoint))]
    if isinstance(config, FinetuneConfig):
        protect += [("pretrained.checkpoint", config.pretrained.checkpoint)]
        outside += [("the run folder of pretrained.checkpoint", run_folder(config.pretrained.checkpoint))]
    return {"kind": KIND, "key": "--output", "overwrite": config.overwrite, "protect": protect, "outside": outside}


def check(config, config_path: Optional[str]) -> None:
    """Bad options and outputs, before any work."""
    if not config.checkpoint:
        raise UserError("--checkpoint is missing: expected the run's checkpoint folder (checkpoints/<run_id>)")
    newest_step(config.checkpoint, name="--checkpoint")  # also refuses a step with unreadable metadata, as train does
    if not isinstance(config, FinetuneConfig) and not is_ode(config.model):
        given = [f"--{k}" for k in ("steps", "solver", "tolerances") if getattr(config, k) is not None]
        if given:
            kind = registry.type_name(config.model)
            raise UserError(
                f"{' and '.join(given)}: model.type={kind} has a fixed depth; solver grids apply to DiffEqFormer checkpoints"
            )
    check_auto(config)
    if config.max_examples is not None:
        if config.tasks is None:
            raise UserError(
                "--max_examples: only with --tasks (examples per lm-eval task; expected --tasks T, or no --max_examples)"
            )
        if isinstance(config.max_examples, bool) or config.max_examples < 1:
            raise UserError(
                f"--max_examples {config.max_examples} is invalid: expected an integer >= 1 (examples per task)"
            )
    if config.tasks is not None:
        harness.task_names(config.tasks)
    if config.per_sequence and config.tolerances is None:
        raise UserError(
            "--per_sequence: needs --tolerances (a fixed grid takes the same evaluations for every sequence)"
        )
    if config.output is not None:
        outputs.check_replaceable(config.output, **_output_rules(config, config_path))
        outputs.check_writable(config.output, "--output", beside=True)


def is_ode(model_config) -> bool:
    return registry.is_ode(model_config)


def points(config):
    if is_auto(config):
        steps = auto_steps.candidates(config.auto_grids, config.model.ode.num_steps)
    else:
        steps = parse_steps(config.steps, config.model.ode.num_steps)
    solvers = parse_list(config.solver, "solver", str, "comma-separated solver names, e.g. euler,rk4")
    tolerances = parse_list(config.tolerances, "tolerances", float, "comma-separated positive numbers, e.g. 1e-2,1e-3")
    return depth.grid_points(config.model.ode, steps, solvers, tolerances, config.adaptive_solver)


def evaluate(config, config_path: Optional[str] = None) -> dict:
    """The rows of the table (and lm-eval's results with --tasks) as a dict."""
    check(config, config_path)
    finetuned = isinstance(config, FinetuneConfig)
    grid = points(config) if not finetuned and is_ode(config.model) else None
    each = None
    if config.tasks is not None:
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


def write(result: dict, config, config_path: Optional[str]) -> list[str]:
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
