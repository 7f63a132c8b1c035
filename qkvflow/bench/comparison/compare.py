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
(qkvflow.runs.outputs: absent, empty, or an earlier report; never the work folder or a folder holding it,
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
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from qkvflow.bench.comparison import depth_curves, halves, lr_grid, matching, run_configs, study_folder
from qkvflow.bench.comparison.pool import Interrupted, Pool, current_pool, raising_on, stop_report
from qkvflow.bench.comparison.report import markdown, report, write_report
from qkvflow.bench.comparison.study_folder import write_json as _write_json
from qkvflow.errors import UserError
from qkvflow.runs import outputs
from qkvflow.runs.outputs import check_writable
from qkvflow.runs.tracking import metrics_file, read_metrics

ROOT = Path(__file__).resolve().parents[3]
STUDY_KEYS = {"base", "baseline", "iters", "learning_rates", "seeds", "models", "title", "depth"}
REPORT_KIND = "bench compare report"
STUDY_ONLY = ("learning_rates", "match")
"""Keys of a model's entry that are the study's business, not its run's (its grid, what it is matched to)."""


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


def load_study(path: str, args) -> dict:
    """The study file with the command line's overrides, checked; `base` resolved beside the file."""
    try:
        study = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UserError(f"bench compare: cannot read study {path}: {e.strerror}") from None
    if not isinstance(study, dict):
        raise UserError(f"bench compare: {path}: expected a mapping with keys {sorted(STUDY_KEYS)}")
    unknown = set(study) - STUDY_KEYS
    if unknown:
        raise UserError(f"bench compare: {path}: unknown key(s) {sorted(unknown)}; expected {sorted(STUDY_KEYS)}")
    for key, given in (("iters", args.iters), ("seeds", args.seeds), ("learning_rates", args.learning_rates)):
        if given is not None:
            study[key] = (
                given if key == "iters" else [float(x) if key == "learning_rates" else int(x) for x in given.split(",")]
            )
    models = study.get("models")
    if not isinstance(models, dict) or not models or not all(isinstance(o, dict) for o in models.values()):
        raise UserError(f"bench compare: {path}: models: expected a mapping of name -> overlay")
    for name, overlay in models.items():
        if args.learning_rates is not None:  # the command line's grid is every model's
            models[name] = {k: v for k, v in overlay.items() if k != "learning_rates"}
        elif "learning_rates" in overlay and not _valid_rates(overlay["learning_rates"]):
            raise UserError(
                f"bench compare: {path}: models.{name}.learning_rates={overlay['learning_rates']!r} is invalid: "
                "expected numbers in (0, 1)"
            )
        if "match" in overlay:
            matching.check(path, name, overlay["match"], models)
    if args.baseline is not None:
        study["baseline"] = args.baseline
    if study.get("baseline") not in models:
        raise UserError(
            f"bench compare: {path}: baseline={study.get('baseline')!r} is not one of the models {sorted(models)}"
        )
    study["defined"] = models  # every model of the file (a matched model's target may be left out of --models)
    if args.models:
        chosen = [m.strip() for m in args.models.split(",") if m.strip()]
        missing = [m for m in chosen if m not in models]
        if missing:
            raise UserError(f"--models: {missing} not in the study's models {sorted(models)}")
        study["joined"] = study["baseline"] not in chosen  # the baseline joins a subset that leaves it out
        chosen = [study["baseline"]] * study["joined"] + chosen
        study["models"] = {m: models[m] for m in dict.fromkeys(chosen)}
    if not isinstance(study.get("iters"), int) or study["iters"] < 1:
        raise UserError(f"bench compare: {path}: iters={study.get('iters')!r} is invalid: expected an integer >= 1")
    lrs, seeds = study.get("learning_rates"), study.get("seeds")
    if not _valid_rates(lrs):
        raise UserError(f"bench compare: {path}: learning_rates={lrs!r} is invalid: expected numbers in (0, 1)")
    if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise UserError(f"bench compare: {path}: seeds={seeds!r} is invalid: expected distinct integers >= 0")
    base = (Path(path).parent / str(study.get("base"))).resolve()
    if not base.is_file():
        raise UserError(f"bench compare: {path}: base={study.get('base')!r}: no such file beside the study")
    study["base"] = str(base)
    study["name"], study["file"] = Path(path).stem, path
    if "depth" in study:  # every chosen ODE run also evaluated at these grids (qkvflow.bench.comparison.depth_curves)
        study["depth"] = depth_curves.check(study["depth"], path)
    study["base_config"] = check_base(str(base))
    return study


def check_base(path: str) -> dict:
    """The base config, checked: a bundled `corpus:` with a known name, or a `data:` section whose
    selection/test halves can be made (qkvflow.bench.comparison.halves; its local paths made absolute)."""
    from qkvflow.data.corpora import NAMES

    try:
        config = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise UserError(f"bench compare: base {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(config, dict):
        raise UserError(f"bench compare: base {path}: expected a `qkvflow train` config (a mapping)")
    corpus = config.get("corpus")
    if corpus is None:
        return halves.check(path, config)
    if not isinstance(corpus, dict) or corpus.get("name") not in NAMES:
        raise UserError(f"bench compare: base {path}: corpus.name: expected one of {', '.join(NAMES)}")
    return config


def _valid_rates(lrs) -> bool:
    return isinstance(lrs, list) and bool(lrs) and all(isinstance(x, (int, float)) and 0 < x < 1 for x in lrs)


def _entry(study: dict, model: str) -> dict:
    """`model`'s entry in the study file (also a model left out of --models: a matched model's target)."""
    return study["models"][model] if model in study["models"] else study["defined"][model]


def learning_rates(study: dict, model: str) -> list:
    """`model`'s learning-rate grid: its own `learning_rates`, else the study's."""
    return _entry(study, model).get("learning_rates", study["learning_rates"])


def _overlay(study: dict, model: str) -> dict:
    """`model`'s overlay of the base config (without what is the study's business: `STUDY_ONLY`)."""
    return {k: v for k, v in _entry(study, model).items() if k not in STUDY_ONLY}


def merge(base: dict, overlay: dict) -> dict:
    """`base` with `overlay` merged in, mappings key by key (a `model:` overlay replaces the base's model)."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if key != "model" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_id(model: str, lr: float, seed: int) -> str:
    return f"{model}-lr{lr:g}-s{seed}"


def run_config(
    study: dict, model: str, lr: float, seed: int, workdir: Path, corpus_root: str, half: str = "selection"
) -> dict:
    """The full `qkvflow train` config of one run, evaluating on `half` (selection or test)."""
    config = merge(study["base_config"], _overlay(study, model))
    if "corpus" in config:
        config["corpus"] = {**config["corpus"], "root": corpus_root, "eval_split": half}
    else:
        config = halves.point_at(config, workdir, half)
    config["data_seed"] = seed
    config["loss_curve"] = None
    t = config.setdefault("trainer", {})
    t.update(id=run_id(model, lr, seed), seed=seed, num_train_steps=study["iters"], steps_per_eval=study["iters"])
    t["checkpointer"] = {**t.get("checkpointer", {}), "base_path": str(workdir / "checkpoints")}
    t["tracker"] = {"type": "jsonl", "path": str(workdir / "runs")}
    t["log_dir"] = str(workdir / "logs")
    config.setdefault("optimizer", {})["learning_rate"] = lr
    return config


def identity(study: dict) -> dict:
    """What must not change between invocations on one work folder: the base config, the budget, and
    each model's definition (seeds, learning rates and further models may be added)."""
    models = {m: _overlay(study, m) for m in study["models"]}
    return {"base": Path(study["base"]).read_text(), "models": models, "iters": study["iters"]}


def resolve(study: dict, workdir: Path, corpus_root: str) -> None:
    """Before the work folder is claimed: every model's run config parsed as `qkvflow train` parses it (a typo
    is refused in one line naming the model: qkvflow.bench.comparison.run_configs), and each matched model's shape
    solved into its overlay (qkvflow.bench.comparison.matching), the solutions kept in `study["matched"]`."""
    matches = {m: _entry(study, m)["match"] for m in study["models"] if "match" in _entry(study, m)}
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
        model = merge(study["base_config"], _overlay(study, m)).get("model") or {}
        study["models"][m]["model"] = {**model, **found["solved"]}
        shape = ", ".join(f"{k} {v}" for k, v in found["solved"].items())
        _say(f"bench compare: {m} matched to {target}'s {matching.MEASURES[kind]} at vocabulary "
             f"{found['vocab_size']}: {shape} ({found['ratio']:.3f}x)")  # fmt: skip
        study["matched"][m] = found


def _subprocess(cmd: list[str], log_file: Path, timeout: float, attention: str = "auto") -> None:
    """`cmd` with its output to `log_file` (`logs/<run>.out`), as a process of the calling task's pool (so
    that a stop reaches it once, qkvflow.bench.comparison.pool); every run's attention kernel is `attention`
    (qkvflow.nn.attention, for the configs that leave attn_backend unset: check_attention refuses any
    other). A failure names the run, what it ran and how it ended."""
    run, verb = log_file.stem, cmd[3]
    options = dict(cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", QKVFLOW_ATTENTION=attention))
    with open(log_file, "a") as log:
        owner = current_pool()
        if owner is None:  # not a task of a pool: nothing can stop it but the terminal
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, **options).returncode
        else:
            code = owner.run(f"{verb} {run}", cmd, timeout, popen=subprocess.Popen, stdout=log,
                             stderr=subprocess.STDOUT, **options)  # fmt: skip
    if code != 0:
        tail = log_file.read_text().strip().splitlines()[-1:]
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        raise UserError(f"bench compare: run {run} ({verb}) failed ({how}; log {log_file}): {' '.join(tail)}")


def _say(line: str) -> None:
    """One line of progress, written whole (runs in flight at once share stdout)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(study: dict, model: str, lr: float, seed: int, workdir: Path, args) -> dict:
    """Train one run (or resume it) and return its result; a finished run is read back, not retrained."""
    rid = run_id(model, lr, seed)
    done = workdir / "results" / f"{rid}.json"
    if done.is_file():
        return json.loads(done.read_text())
    config_path = workdir / "configs" / f"{rid}.yaml"
    config_path.write_text(
        yaml.safe_dump(run_config(study, model, lr, seed, workdir, args.corpus_root), sort_keys=False)
    )
    _say(f"bench compare: training {rid} ({study['iters']} steps)")
    start = time.perf_counter()
    _subprocess(
        [sys.executable, "-m", "qkvflow", "train", "--config_path", str(config_path)],
        workdir / "logs" / f"{rid}.out",
        args.timeout,
        args.attention,
    )
    file = metrics_file(str(workdir / "runs"), rid)
    steps = read_metrics(file)
    evals = [s for s in sorted(steps) if "eval/loss" in steps[s]]
    if not evals or evals[-1] != study["iters"] - 1:
        raise UserError(f"bench compare: {rid} has no eval loss after its last step in {file}")
    summary = {}
    with open(file) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "summary":
                summary.update(record.get("metrics", {}))
    result = {
        "model": model, "learning_rate": lr, "seed": seed, "selection_loss": steps[evals[-1]]["eval/loss"],
        "train_loss": steps[evals[-1]].get("train/loss"), "parameter_count": summary.get("parameter_count"),
        "wall_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    _write_json(done, result)
    return result


def test_loss(study: dict, model: str, lr: float, seed: int, workdir: Path, args) -> float:
    """The run's final model on the test half (`qkvflow eval`); read back if already measured."""
    rid = run_id(model, lr, seed)
    done = workdir / "results" / f"{rid}.test.json"
    if done.is_file():
        return json.loads(done.read_text())["test_loss"]
    if not (workdir / "checkpoints" / rid).is_dir():
        raise UserError(
            f"bench compare: {rid} is now a chosen run but its checkpoint was removed after an earlier selection; "
            "use a new --workdir (and --keep_checkpoints when you plan to add seeds or learning rates)"
        )
    out = workdir / "test" / rid
    shutil.rmtree(out, ignore_errors=True)  # a partial output of this study's own earlier attempt
    config_path, split = workdir / "configs" / f"{rid}.yaml", ["--corpus.eval_split", "test"]
    if "corpus" not in study["base_config"]:  # own data: the run's config reading the test half instead
        config_path, split = workdir / "configs" / f"{rid}.test.yaml", []
        config = run_config(study, model, lr, seed, workdir, args.corpus_root, half="test")
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "qkvflow", "eval", "--config_path", str(config_path),
           "--checkpoint", str(workdir / "checkpoints" / rid), *split, "--output", str(out)]  # fmt: skip
    if _is_ode(study, model):
        cmd += depth_curves.eval_args(study.get("depth"))
    _say(f"bench compare: evaluating {rid} on the test split")
    _subprocess(cmd, workdir / "logs" / f"{rid}.out", args.timeout, args.attention)
    rows = json.loads((out / "depth.json").read_text())["rows"]
    row = depth_curves.trained_row(rows)
    _write_json(done, {"test_loss": row["loss"], "depth": rows})
    return row["loss"]


def _is_ode(study: dict, model: str) -> bool:
    from qkvflow.models import registry

    kind = (_overlay(study, model).get("model") or {}).get("type")
    return kind in {f.name for f in registry.families() if f.ode}


def depth_report(study: dict, tests: dict, workdir: Path) -> dict:
    """Per ODE model, its chosen runs' test rows at every grid summarised over seeds (`depth_curves`)."""
    models = {}
    for model, per_seed in tests.items():
        if _is_ode(study, model):
            lr = per_seed["learning_rate"]
            rows = {s: json.loads((workdir / "results" / f"{run_id(model, lr, s)}.test.json").read_text())["depth"]
                    for s in study["seeds"]}  # fmt: skip
            models[model] = depth_curves.summarise(rows)
    return {"study": study["name"], "title": study.get("title") or study["name"], "iters": study["iters"],
            "seeds": study["seeds"], "grids": study["depth"], "models": models}  # fmt: skip


def training_flops(config_path: Path, iters: int) -> Optional[float]:
    """3 x forward FLOPs of the run whose config is `config_path` (read as `qkvflow train` reads it), for
    `iters` steps (`run_configs.training_flops`)."""
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.configfile import parse

    return run_configs.training_flops(parse(TrainConfig, ["--config_path", str(config_path)], "train"), iters)


def check_attention(study: dict, args) -> None:
    """One kernel for every run: --attention is known, and no model's config names a backend of its own."""
    from qkvflow.nn.attention import CHOICES

    if args.attention not in CHOICES:
        raise UserError(f"--attention={args.attention} is invalid: expected one of {', '.join(CHOICES)}")
    base = yaml.safe_load(Path(study["base"]).read_text())
    for model in study["models"]:
        own = (merge(base, _overlay(study, model)).get("model") or {}).get("attn_backend")
        if own not in (None, "default"):
            raise UserError(
                f"bench compare: model {model} sets model.attn_backend={own}: every run takes --attention "
                f"({args.attention}), so that no model gets a kernel of its own; drop the key"
            )


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
        _say(f"bench compare: {model} chose {best:g}, the {side} of {grid}: adding {rate:g} (--extend_grid, "
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
    _say(f"bench compare: --models leaves out the baseline {base}: it joins them, and {how}")


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
