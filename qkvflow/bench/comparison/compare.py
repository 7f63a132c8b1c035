"""`qkvflow bench compare STUDY.yaml`: models x learning rates x seeds, chosen on one split, reported on another.

A study file (benchmarks/compare/*.yaml) names a base `qkvflow train` config (a bundled `corpus:`, or a
`data:` section reading your own jsonl files and tokenizer, e.g. a `qkvflow tokenizer` folder; trainer,
optimizer), a budget (`iters`), peak `learning_rates`, `seeds`, a `baseline` and the `models`, each a
YAML overlay merged into the base (a `model:` section, and optionally `optimizer:` keys) with, where
one grid does not fit every model, its own `learning_rates` (`--learning_rates` overrides all). Then:

1. every (model, learning rate, seed) trains through `qkvflow train` (trainer.seed = data_seed =
   seed), evaluating on the `selection` half of the held-out documents (a corpus's `corpus.eval_split`,
   qkvflow.data.corpora; for a `data:` section the halves are made from its validation documents by
   the same rule, qkvflow.bench.comparison.halves): its last eval loss is its selection loss;
2. per model, the learning rate with the lowest mean selection loss over the seeds is chosen; a choice at
   the lowest or highest rate of its grid is marked "at the grid's edge", and with `--extend_grid` the
   next rate beyond that edge is added and the choice made again (qkvflow.bench.comparison.lr_grid);
3. the chosen runs alone are evaluated on the `test` half (`qkvflow eval`);
4. per model: mean and standard deviation of the test loss over seeds, and the paired 95% interval
   of its difference to the baseline (qkvflow.bench.comparison.stats), with the parameter count and the
   training FLOPs (3 x forward: qkvflow.models.accounting, Levanter's `flops_per_token`), and for a model
   declared by what it matches (`match: {params: MODEL}` or `{train_flops: MODEL}`, its width solved on the
   study's own vocabulary before anything trains: qkvflow.bench.comparison.matching), the achieved ratio.

The report is <name>.json, a markdown table <name>.md and a figure <name>.png (each model's test loss
per seed, and mean +- sd; qkvflow.bench.comparison.report), written into the work folder's `report/`, or
into `--out_dir`: a folder for this report alone, checked and replaced as every qkvflow output is
(qkvflow.outputs: absent, empty, or an earlier report; never the work folder or a folder holding it,
never inside the repository's shipped folders). The paths written are printed. The base config and every
model's run config (parsed as `qkvflow train` parses it: qkvflow.bench.comparison.run_configs) are checked, and the
matched widths solved, before the work folder is claimed.

`--models A,B` runs a subset; the baseline joins it when left out (its finished runs read back, the
missing ones trained), which a line says.

It is resumable: a finished run leaves `results/<run>.json` and is not trained again; an interrupted run
resumes from its checkpoint (the same `trainer.id`, qkvflow's exact resume); more seeds, learning rates
and models may be added to a study between invocations, and a model with no run yet may be redefined.
The work folder holds `study.json`, written when the study starts (qkvflow.bench.comparison.study_folder): a folder
without it (and not empty) or holding another study is refused, and only checkpoints of this study's
runs are removed (after a model's test evaluation, unless --keep_checkpoints). `--jobs K` runs K
trainings or evaluations at once, each its own process as always (a GPU shared by small models, or spare
cores), a model's test evaluations ahead of the trainings still waiting (qkvflow.bench.comparison.pool); the results
are the same. docs/compare.md is the guide.
"""

import argparse
import shutil
import signal
import sys
from pathlib import Path

from qkvflow import outputs
from qkvflow.bench.comparison import depth_curves, halves, lr_grid, matching, run_configs, study_folder
from qkvflow.bench.comparison.pool import Interrupted, Pool, raising_on, stop_report
from qkvflow.bench.comparison.report import markdown, report, write_report
from qkvflow.bench.comparison.run_processes import ROOT, depth_report, say, test_loss, train, training_flops
from qkvflow.bench.comparison.study import (
    check_attention,
    identity,
    learning_rates,
    load_study,
    merge,
    model_entry,
    model_overlay,
    run_config,
    run_id,
)
from qkvflow.outputs import check_writable

REPORT_KIND = "bench compare report"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvflow bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="study YAML (e.g. benchmarks/compare/tinyshakespeare.yaml)")
    p.add_argument("--workdir", required=True, help="where runs, checkpoints and partial results live (resumable)")
    p.add_argument("--out_dir", default=None, help="a folder for the report alone (default: WORKDIR/report)")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--name", default=None, help="the report's files NAME.{json,md,png} (default: the study's name)")
    p.add_argument("--iters", type=int, default=None, help="override the study's budget (training steps per run)")
    p.add_argument("--seeds", default=None, help="override the seeds, comma-separated")
    p.add_argument("--learning_rates", default=None, help="override the peak learning rates, comma-separated")
    p.add_argument("--models", default=None, help="a comma-separated subset of the study's models")
    p.add_argument(
        "--attention",
        default="auto",
        help="the attention kernel of every run, baseline and DiffEqFormer alike (qkvflow.nn.attention: auto, "
        "cudnn, xla, vanilla, jax_flash, splash, nvte; passed as $QKVFLOW_ATTENTION; default auto)",
    )
    p.add_argument(
        "--extend_grid",
        type=_positive_int,
        nargs="?",
        const=lr_grid.LIMIT,
        default=0,
        metavar="K",
        help="when a model's chosen learning rate is the lowest or highest of its grid, add the next rate beyond "
        f"it (half or twice) and choose again, until the choice is interior or K rates were added (default K "
        f"{lr_grid.LIMIT})",
    )
    p.add_argument("--baseline", default=None, help="pair the others with this model instead")
    p.add_argument("--corpus_root", default=str(ROOT / "cache" / "corpora"))
    p.add_argument("--keep_checkpoints", action="store_true")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per training run")
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="runs at once, each its own process (default 1); more suits a machine with cores or an "
        "accelerator to spare for small models: every training is queued at the start, and a model's test "
        "evaluations, once its grid is trained, go ahead of the trainings still waiting",
    )
    return p


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer >= 1")
    return int(text)


def resolve(study: dict, workdir: Path, corpus_root: str) -> None:
    """Before the work folder is claimed: every model's run config parsed as `qkvflow train` parses it (a typo
    is refused in one line naming the model: qkvflow.bench.comparison.run_configs), and each matched model's shape
    solved into its overlay (qkvflow.bench.comparison.matching), the solutions kept in `study["matched"]`."""
    matches = {m: model_entry(study, m)["match"] for m in study["models"] if "match" in model_entry(study, m)}
    names = dict.fromkeys([*study["models"], *(t for match in matches.values() for t in match.values())])
    parsed = {
        m: run_configs.parsed(
            run_config(study, m, learning_rates(study, m)[0], study["seeds"][0], workdir, corpus_root),
            f"bench compare: {study['file']}: models.{m}",
        )
        for m in names
    }
    study["matched"] = {}
    for m, match in matches.items():
        ((kind, target),) = match.items()
        found = matching.solve(study["file"], m, match, parsed[m], parsed[target], study["iters"])
        model = merge(study["base_config"], model_overlay(study, m)).get("model") or {}
        study["models"][m]["model"] = {**model, **found["solved"]}
        shape = ", ".join(f"{k} {v}" for k, v in found["solved"].items())
        say(f"bench compare: {m} matched to {target}'s {matching.MEASURES[kind]} at vocabulary "
             f"{found['vocab_size']}: {shape} ({found['ratio']:.3f}x)")  # fmt: skip
        study["matched"][m] = found


def _submit_grid(pool: Pool, study: dict, model: str, workdir: Path, args) -> list:
    """`model`'s training runs (every learning rate x seed) queued on `pool`, in the grid's order."""
    return [pool.submit(1, train, study, model, lr, seed, workdir, args) for lr in learning_rates(study, model)
            for seed in study["seeds"]]  # fmt: skip


def settle(pool: Pool, study: dict, model: str, queued: list, workdir: Path, args) -> tuple[list, dict]:
    """`model`'s runs (`queued` on `pool`) and its choice of learning rate; with --extend_grid K, a choice at the
    grid's edge adds the next rate beyond it, trained on every seed ahead of later models, until the choice
    is interior or K rates were added (qkvflow.bench.comparison.lr_grid). The grid chosen from becomes the model's."""
    grid, added = list(learning_rates(study, model)), []
    mine = [f.result() for f in queued]
    while True:
        best = lr_grid.choose({lr: [r["selection_loss"] for r in mine if r["learning_rate"] == lr] for lr in grid})
        side = lr_grid.edge(best, grid)
        rate = lr_grid.beyond(grid, side) if side else None
        if rate is None or len(added) >= args.extend_grid:
            break
        say(f"bench compare: {model} chose {best:g}, the {side} of {grid}: adding {rate:g} (--extend_grid, "
             f"{len(added) + 1} of at most {args.extend_grid})")  # fmt: skip
        grid, added = sorted([*grid, rate]), [*added, rate]
        mine += [
            f.result() for f in [pool.submit(0, train, study, model, rate, s, workdir, args) for s in study["seeds"]]
        ]
    if added:
        study["models"][model]["learning_rates"] = grid  # not part of the model's definition (identity)
    stopped = bool(side and added and len(added) >= args.extend_grid)  # still at the edge: the limit stopped it
    return mine, {"learning_rate": best, "grid": grid, "added": added, "edge": side, "limit_reached": stopped}


def _joined(study: dict, workdir: Path) -> None:
    """Say that the baseline joined a --models subset, and whether its runs are read back or trained."""
    base = study["baseline"]
    runs = [run_id(base, lr, s) for lr in learning_rates(study, base) for s in study["seeds"]]
    missing = [r for r in runs if not (workdir / "results" / f"{r}.json").is_file()]
    how = (f"its {len(runs)} runs are read back from {workdir / 'results'}" if not missing else
           f"{len(missing)} of its {len(runs)} runs are not in {workdir / 'results'} and are trained")  # fmt: skip
    say(f"bench compare: --models leaves out the baseline {base}: it joins them, and {how}")


def _run_study(pool: Pool, study: dict, workdir: Path, args, runs: list, tests: dict, flops: dict, chosen: dict):
    """Train every model's grid on `pool`, choose, and test the chosen runs, filling the four results."""
    # with --jobs 1 a model's runs start only once the previous model is evaluated (as before --jobs)
    trains = {}
    if args.jobs > 1:
        trains = {model: _submit_grid(pool, study, model, workdir, args) for model in study["models"]}
    for model in study["models"]:
        queued = trains.get(model) or _submit_grid(pool, study, model, workdir, args)
        mine, chosen[model] = settle(pool, study, model, queued, workdir, args)
        runs += mine
        best = chosen[model]["learning_rate"]
        evals = {seed: pool.submit(0, test_loss, study, model, best, seed, workdir, args) for seed in study["seeds"]}
        tests[model] = {seed: f.result() for seed, f in evals.items()}
        flops[model] = training_flops(
            workdir / "configs" / f"{run_id(model, best, study['seeds'][0])}.yaml", study["iters"]
        )
        if not args.keep_checkpoints:
            for r in mine:  # this study's own runs (study.json claimed the folder), all evaluated
                shutil.rmtree(
                    workdir / "checkpoints" / run_id(model, r["learning_rate"], r["seed"]), ignore_errors=True
                )


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    study = load_study(args.study, args)
    check_attention(study, args)
    workdir = Path(args.workdir).resolve()
    report_rules = {
        "kind": REPORT_KIND, "key": "--out_dir", "overwrite": args.overwrite, "protect": [("--workdir", str(workdir))]
    }  # fmt: skip
    for key, folder in (("--workdir", workdir), ("--out_dir", args.out_dir)):
        outputs.check_outside_repository(folder, key)
    if args.out_dir is not None:  # before any work, as every output
        outputs.check_replaceable(args.out_dir, **report_rules)
        check_writable(args.out_dir, "--out_dir", beside=True)
    resolve(study, workdir, args.corpus_root)
    study_folder.claim(workdir, identity(study))
    for sub in ("configs", "results", "logs", "test"):
        (workdir / sub).mkdir(exist_ok=True)
    if "corpus" not in study["base_config"]:
        halves.write(study["base_config"], workdir)
    if study.get("joined"):
        _joined(study, workdir)
    runs, tests, flops, chosen = [], {}, {}, {}
    pool = Pool(args.jobs)
    try:
        with raising_on():  # SIGTERM or a hang-up stops the runs as Ctrl-C does
            _run_study(pool, study, workdir, args, runs, tests, flops, chosen)
    except (KeyboardInterrupt, Interrupted) as e:  # each running run is stopped once; nothing new starts
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        waiting = pool.waiting()
        stopped = pool.stop_and_wait(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        print(stop_report(signal.Signals(signum).name, stopped, waiting), file=sys.stderr, flush=True)
        return 128 + signum
    finally:  # an error: runs not yet started are dropped, running ones finish first
        pool.shutdown()
    result = report(study, runs, tests, flops, chosen)
    result["attention"] = args.attention
    curves = depth_report(study, chosen, workdir) if "depth" in study else None
    name = args.name or study["name"]
    table = markdown(result)
    if args.out_dir is None:
        (workdir / "report").mkdir(exist_ok=True)
        written = write_report(workdir / "report", name, result, table, curves)
    else:
        with outputs.replacing(args.out_dir, **report_rules) as folder:
            written = [Path(args.out_dir) / p.name for p in write_report(Path(folder), name, result, table, curves)]
    print(table)
    if curves is not None:
        print(depth_curves.markdown(curves))
    for path in written:
        print(f"bench compare: wrote {path}", flush=True)
    return 0
