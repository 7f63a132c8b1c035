"""`qkvflow bench compare STUDY.yaml`: models x learning rates x seeds, chosen on one split, reported on another.

A study file (benchmarks/compare/*.yaml) names a base `qkvflow train` config (a bundled `corpus:`, or a
`data:` section reading your own jsonl files and tokenizer, e.g. a `qkvflow tokenizer` folder; trainer,
optimizer), a budget (`iters`), peak `learning_rates`, `seeds`, a `baseline` and the `models`, each a
YAML overlay merged into the base (a `model:` section, and optionally `optimizer:` keys) with, where
one grid does not fit every model, its own `learning_rates` (`--learning_rates` overrides all). Then:

1. every (model, learning rate, seed) trains through `qkvflow train` (trainer.seed = data_seed =
   seed), evaluating on the `selection` half of the held-out documents (a corpus's `corpus.eval_split`,
   qkvflow.data.corpora; for a `data:` section the halves are made from its validation documents by
   the same rule, qkvflow.bench.halves): its last eval loss is its selection loss;
2. per model, the learning rate with the lowest mean selection loss over the seeds is chosen;
3. the chosen runs alone are evaluated on the `test` half (`qkvflow eval`);
4. per model: mean and standard deviation of the test loss over seeds, and the paired 95% interval
   of its difference to the baseline (qkvflow.bench.stats), with the parameter count and the
   training FLOPs (3 x forward: qkvflow.models.accounting, Levanter's `flops_per_token`).

The report is <name>.json, a markdown table <name>.md and a figure <name>.png (each model's test loss
per seed, and mean +- sd), written into the work folder's `report/`, or into `--out_dir`: a folder for this report
alone, checked and replaced as every qkvflow output is (qkvflow.outputs: absent, empty, or an earlier
report). The paths written are printed. The base config is checked before the work folder is claimed.

It is resumable: a finished run leaves `results/<run>.json` and is not trained again; an
interrupted run resumes from its checkpoint (the same `trainer.id`, qkvflow's exact resume); more
seeds or learning rates may be added to a study between invocations. The work folder holds
`study.json`, written when the study starts: a folder without it (and not empty) or holding another
study is refused, and only checkpoints of this study's runs are removed (after a model's test
evaluation, unless --keep_checkpoints). `--jobs K` runs K trainings or evaluations at once, each its own
process as always (a GPU shared by small models, or spare cores), a model's test evaluations ahead of the
trainings still waiting (`_Pool`); the results are the same.
"""

import argparse
import copy
import dataclasses
import heapq
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import yaml

from qkvflow import outputs
from qkvflow.bench import depth_curves, halves, stats
from qkvflow.errors import UserError
from qkvflow.outputs import check_writable
from qkvflow.training.tracking import metrics_file, read_metrics

ROOT = Path(__file__).resolve().parents[2]
STUDY_KEYS = {"base", "baseline", "iters", "learning_rates", "seeds", "models", "title", "depth"}
REPORT_KIND = "bench compare report"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvflow bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="study YAML (e.g. benchmarks/compare/tinyshakespeare.yaml)")
    p.add_argument("--workdir", required=True, help="where runs, checkpoints and partial results live (resumable)")
    p.add_argument("--out_dir", default=None, help="a folder for the report alone (default: WORKDIR/report)")
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
    if args.models:
        chosen = [m.strip() for m in args.models.split(",") if m.strip()]
        missing = [m for m in chosen if m not in models]
        if missing:
            raise UserError(f"--models: {missing} not in the study's models {sorted(models)}")
        study["models"] = {m: models[m] for m in chosen}
    if args.baseline is not None:
        study["baseline"] = args.baseline
    if study.get("baseline") not in study["models"]:
        raise UserError(
            f"bench compare: {path}: baseline={study.get('baseline')!r} is not one of the models {sorted(study['models'])}"
        )
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
    study["name"] = Path(path).stem
    if "depth" in study:  # every chosen ODE run also evaluated at these grids (qkvflow.bench.depth_curves)
        study["depth"] = depth_curves.check(study["depth"], path)
    study["base_config"] = check_base(str(base))
    return study


def check_base(path: str) -> dict:
    """The base config, checked: a bundled `corpus:` with a known name, or a `data:` section whose
    selection/test halves can be made (qkvflow.bench.halves; its local paths made absolute)."""
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


def learning_rates(study: dict, model: str) -> list:
    """`model`'s learning-rate grid: its own `learning_rates`, else the study's."""
    return study["models"][model].get("learning_rates", study["learning_rates"])


def _overlay(study: dict, model: str) -> dict:
    """`model`'s overlay of the base config (its grid is the study's business, not the run's)."""
    return {k: v for k, v in study["models"][model].items() if k != "learning_rates"}


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


def claim_workdir(workdir: Path, study: dict) -> None:
    marker = workdir / "study.json"
    mine = identity(study)
    if marker.is_file():
        held = json.loads(marker.read_text())
        changed = [m for m in mine["models"] if m in held["models"] and held["models"][m] != mine["models"][m]]
        if (held["base"], held["iters"]) != (mine["base"], mine["iters"]) or changed:
            what = f"model {changed[0]!r}" if changed else "base or iters"
            raise UserError(
                f"--workdir {workdir} holds another study (its study.json differs in {what}); use a new --workdir"
            )
        if set(mine["models"]) - set(held["models"]):  # a model added to the study: record it
            held["models"] = {**held["models"], **mine["models"]}
            _write_json(marker, held)
        return
    if workdir.exists() and any(workdir.iterdir()):
        raise UserError(f"--workdir {workdir} is not empty and holds no study.json: choose a new or empty folder")
    check_writable(str(workdir), "--workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(mine, indent=1) + "\n")


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)  # a result file is whole or absent


def _subprocess(cmd: list[str], log_file: Path, timeout: float, attention: str = "auto") -> None:
    """`cmd` with its output to `log_file`; every run's attention kernel is `attention` (qkvflow.nn.attention,
    for the configs that leave attn_backend unset: check_attention refuses any other)."""
    with open(log_file, "a") as log:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", QKVFLOW_ATTENTION=attention),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    if proc.returncode != 0:
        tail = log_file.read_text().strip().splitlines()[-1:]
        raise UserError(
            f"bench compare: {' '.join(cmd[3:5])} failed (exit {proc.returncode}; log {log_file}): {' '.join(tail)}"
        )


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
    """3 x forward FLOPs of one run: per-token FLOPs x tokens, plus an ODE's hypernetwork per forward pass;
    with depth-dial recipes, the mean over the solves a batch runs (`depth_dial.training_solves`)."""
    from qkvflow.configfile import parse
    from qkvflow.data.corpora import corpus_vocab_size
    from qkvflow.models import accounting, registry
    from qkvflow.training import data_checks
    from qkvflow.training.config import TrainConfig

    config = parse(TrainConfig, ["--config_path", str(config_path)], "train")  # as `qkvflow train` reads it
    if config.corpus is not None:
        vocab = corpus_vocab_size(config.corpus.name, vocab_size=config.corpus.vocab_size)
    else:
        vocab = len(data_checks.load_tokenizer(config.data))
    seq, batch = config.model.max_seq_len, config.trainer.train_batch_size
    if config.model.flops_per_token(vocab, seq) is None:
        return None

    def forward(model) -> float:
        per_step = model.flops_per_token(vocab, seq) * seq * batch
        if registry.is_ode(model):
            per_step += accounting.hypernetwork_flops_per_forward(model, vocab)
        return per_step

    solves = [(config.model, 1.0)]
    dial = getattr(config.model, "dial", None)
    if dial is not None and dial.active:  # the drawn step counts' mean, and a consistency term's fine solve
        from qkvflow.models.depth_dial import training_solves

        def at(n: int):
            return dataclasses.replace(config.model, ode=dataclasses.replace(config.model.ode, num_steps=n))

        solves = [(at(n), weight) for n, weight in training_solves(config.model)]
    return 3.0 * math.fsum(weight * forward(model) for model, weight in solves) * iters


def report(study: dict, runs: list[dict], tests: dict, flops: dict) -> dict:
    models = {}
    for model in study["models"]:
        mine = [r for r in runs if r["model"] == model]
        by_lr = {}
        for r in mine:
            by_lr.setdefault(r["learning_rate"], {})[r["seed"]] = r["selection_loss"]
        best = min(by_lr, key=lambda lr: stats.summarise(by_lr[lr].values()).mean)
        test = tests[model]
        s = stats.summarise(test.values())
        models[model] = {
            "best_learning_rate": best,
            "learning_rates": learning_rates(study, model),
            "selection": {f"{lr:g}": stats.summarise(v.values()).__dict__ for lr, v in sorted(by_lr.items())},
            "test": {"per_seed": {str(k): v for k, v in sorted(test.items())}, **s.__dict__},
            "parameter_count": next((r["parameter_count"] for r in mine if r["parameter_count"]), None),
            "training_flops": flops[model],
            "wall_s": round(sum(r["wall_s"] for r in mine), 1),
        }
    base = tests[study["baseline"]]
    for model, entry in models.items():
        if model != study["baseline"]:
            d = stats.paired_difference(tests[model], base)
            entry["difference_to_baseline"] = {
                "seeds": list(d.seeds),
                "mean": d.mean,
                "ci95": [d.low, d.high],
                "verdict": d.verdict,
            }
    return {"study": study["name"], "title": study.get("title"), "iters": study["iters"], "baseline": study["baseline"],
            "learning_rates": study["learning_rates"], "seeds": study["seeds"], "models": models}  # fmt: skip


def markdown(result: dict) -> str:
    def f(x, digits=4):
        return "-" if x is None else f"{x:.{digits}f}"

    grids = "".join(
        f"; {m} from {e['learning_rates']}"
        for m, e in result["models"].items()
        if e["learning_rates"] != result["learning_rates"]
    )
    lines = [
        f"{result.get('title') or result['study']}: {result['iters']} steps, seeds {result['seeds']}, peak lr chosen from "
        f"{result['learning_rates']}{grids} on the selection split; test split below. Baseline: {result['baseline']}.",
        "",
        "| model | params | train FLOPs | best lr | test loss (mean ± sd) | Δ to baseline [95% CI] | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, m in result["models"].items():
        t, d = m["test"], m.get("difference_to_baseline")
        diff = "-" if d is None else f"{d['mean']:+.4f} [{f(d['ci95'][0])}, {f(d['ci95'][1])}]"
        flops = "-" if m["training_flops"] is None else f"{m['training_flops']:.3g}"
        params = "-" if m["parameter_count"] is None else f"{m['parameter_count'] / 1e6:.2f}M"
        lines.append(
            f"| {name} | {params} | {flops} | {m['best_learning_rate']:g} | {f(t['mean'])} ± {f(t['std'])} | {diff} | "
            f"{'baseline' if d is None else d['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Each model's test loss per seed (dots) and mean +- sd (bar), the baseline's mean as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["models"])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 4.2), dpi=110)
    for i, name in enumerate(names):
        test = result["models"][name]["test"]
        seeds = list(test["per_seed"].values())
        ax.plot([i] * len(seeds), seeds, "o", color="0.6", markersize=4)
        ax.errorbar([i], [test["mean"]], yerr=[test["std"] or 0.0], fmt="s", color="C0", capsize=4)
    ax.axhline(result["models"][result["baseline"]]["test"]["mean"], color="C3", ls="--", lw=1, label="baseline mean")
    labels = []
    for name in names:
        params = result["models"][name]["parameter_count"]
        labels.append(name if params is None else f"{name}\n{params / 1e6:.2f}M")
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("test loss (nats/token)")
    ax.set_title(f"{result.get('title') or result['study']}: {result['iters']} steps", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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


class _Pool:
    """Runs tasks on threads of their own (each waits on a subprocess), at most `jobs` at once; a waiting task
    of lower `priority` starts first, ties in the order submitted: a model's test evaluations (0) go before
    the trainings still queued for later models (1), so results come model by model."""

    def __init__(self, jobs: int):
        self._ready = threading.Condition()
        self._free, self._waiting, self._order, self._closed = jobs, [], itertools.count(), False
        self._threads: list[threading.Thread] = []

    def submit(self, priority: int, fn, *args) -> Future:
        future, ticket = Future(), (priority, next(self._order))
        with self._ready:
            heapq.heappush(self._waiting, ticket)
        thread = threading.Thread(target=self._run, args=(ticket, future, fn, args), daemon=True)
        self._threads.append(thread)
        thread.start()
        return future

    def _run(self, ticket, future: Future, fn, args) -> None:
        with self._ready:
            self._ready.wait_for(lambda: self._closed or (self._free > 0 and self._waiting[0] == ticket))
            if self._closed or not future.set_running_or_notify_cancel():
                future.cancel()
                return
            heapq.heappop(self._waiting)
            self._free -= 1
            self._ready.notify_all()
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (a Ctrl-C in a run reaches the main thread through .result())
            future.set_exception(e)
        finally:
            with self._ready:
                self._free += 1
                self._ready.notify_all()

    def shutdown(self) -> None:
        """Drop the tasks not started; wait for the running ones (a Ctrl-C has reached their processes too)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()


def _submit_grid(pool: _Pool, study: dict, model: str, workdir: Path, args) -> list:
    """`model`'s training runs (every learning rate x seed) queued on `pool`, in the grid's order."""
    return [pool.submit(1, train, study, model, lr, seed, workdir, args) for lr in learning_rates(study, model)
            for seed in study["seeds"]]  # fmt: skip


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    study = load_study(args.study, args)
    check_attention(study, args)
    workdir = Path(args.workdir).resolve()
    report_rules = {"kind": REPORT_KIND, "key": "--out_dir", "protect": [("--workdir", str(workdir))]}
    if args.out_dir is not None:  # before any work, as every output
        outputs.check_replaceable(args.out_dir, **report_rules)
        check_writable(args.out_dir, "--out_dir", beside=True)
    claim_workdir(workdir, study)
    for sub in ("configs", "results", "logs", "test"):
        (workdir / sub).mkdir(exist_ok=True)
    if "corpus" not in study["base_config"]:
        halves.write(study["base_config"], workdir)
    runs, tests, flops, chosen = [], {}, {}, {}
    pool = _Pool(args.jobs)
    try:
        # with --jobs 1 a model's runs start only once the previous model is evaluated (as before --jobs)
        trains = {}
        if args.jobs > 1:
            trains = {model: _submit_grid(pool, study, model, workdir, args) for model in study["models"]}
        for model in study["models"]:
            grid = learning_rates(study, model)
            mine = [f.result() for f in trains.get(model) or _submit_grid(pool, study, model, workdir, args)]
            runs += mine
            by_lr = {lr: [r["selection_loss"] for r in mine if r["learning_rate"] == lr] for lr in grid}
            best = min(by_lr, key=lambda lr: math.fsum(by_lr[lr]) / len(by_lr[lr]))
            evals = {
                seed: pool.submit(0, test_loss, study, model, best, seed, workdir, args) for seed in study["seeds"]
            }
            tests[model] = {seed: f.result() for seed, f in evals.items()}
            chosen[model] = {"learning_rate": best}
            flops[model] = training_flops(
                workdir / "configs" / f"{run_id(model, best, study['seeds'][0])}.yaml", study["iters"]
            )
            if not args.keep_checkpoints:
                for r in mine:  # this study's own runs (study.json claimed the folder), all evaluated
                    shutil.rmtree(
                        workdir / "checkpoints" / run_id(model, r["learning_rate"], r["seed"]), ignore_errors=True
                    )
    finally:  # an error or Ctrl-C: runs not yet started are dropped, running ones finish (or stop) first
        pool.shutdown()
    result = report(study, runs, tests, flops)
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


def write_report(folder: Path, name: str, result: dict, table: str, curves: Optional[dict] = None) -> list[Path]:
    """NAME.json, NAME.md and NAME.png in `folder`, each written whole (a temporary file, then renamed),
    and with `curves` (a study's `depth:` section) NAME_depth.json, .md and .png beside them."""
    paths = _write_three(folder, name, result, table, plot)
    if curves is not None:
        paths += _write_three(folder, f"{name}_depth", curves, depth_curves.markdown(curves), depth_curves.plot)
    return paths


def _write_three(folder: Path, name: str, data: dict, table: str, plot_fn) -> list[Path]:
    paths = [folder / f"{name}.{ext}" for ext in ("json", "md", "png")]
    _write_json(paths[0], data)
    tmp = paths[1].with_suffix(".md.tmp")
    tmp.write_text(table)
    os.replace(tmp, paths[1])
    tmp = folder / f".{name}.tmp.png"
    plot_fn(data, tmp)
    os.replace(tmp, paths[2])
    return paths
