"""`qkvflow bench exits --workdir W`: the Depth-Adaptive Transformer's exits against n-layer models,
from the checkpoints of a `qkvflow bench compare` study (benchmarks/compare/exits.yaml, run with
--keep_checkpoints).

For every run in W (its configs/<run>.yaml and checkpoints/<run>):

* a `parallel_gpt2` of n layers: its loss and accuracy on the `selection` and `test` halves;
* an exits model (`adaptive_*`, qkvflow.models.related.adaptive): every exit's loss and accuracy (all tokens
  leave at exit n: the n-block truncation), and confidence-threshold exits with copy-up for each tau of
  the grid on both halves. The tau reported is chosen on `selection` alone: the one with the lowest
  average exit whose selection loss is at most (1 + tolerance) x the last exit's selection loss.

FLOPs per token (qkvflow.evaluation.exits: every classifier a threshold reads costs 2 V d) at the
corpus's vocabulary and, as accounting only (the same exits, another classifier size), at
--flops_vocab (default 2,048, the pydoc corpus's BPE vocabulary). Writes OUT_DIR/NAME.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from qkvflow import outputs
from qkvflow.bench import OUT_DIR
from qkvflow.data import cache_lock
from qkvflow.errors import UserError
from qkvflow.evaluation import exits as ex
from qkvflow.evaluation import perplexity
from qkvflow.models.related.adaptive import AdaptiveGpt2Config, AdaptiveLMHeadModel
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.configfile import parse
from qkvflow.runs.corpus import with_corpus
from qkvflow.runs.model import load_model

TAUS = "0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95,0.99"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvflow bench exits", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="the `bench compare` work folder (runs kept: --keep_checkpoints)")
    p.add_argument("--out_dir", default=OUT_DIR, help=f"folder of the output files (default {OUT_DIR})")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--name", default="exits")
    p.add_argument("--taus", default=TAUS, help="confidence thresholds, comma-separated")
    p.add_argument("--tolerance", type=float, default=0.01, help="relative selection-loss slack of the chosen tau")
    p.add_argument("--flops_vocab", type=int, default=2048, help="a second vocabulary for the FLOPs accounting")
    return p


def _runs(workdir: Path) -> list[dict]:
    """Each finished run of the folder that kept its checkpoint: its id, config path, model config and seed."""
    runs = []
    for path in sorted((workdir / "configs").glob("*.yaml")):
        rid = path.stem
        if not (workdir / "checkpoints" / rid).is_dir() or not (workdir / "results" / f"{rid}.json").is_file():
            continue  # removed, or not finished training
        config = parse(TrainConfig, ["--config_path", str(path)], "train")
        runs.append({"run": rid, "config_path": str(path), "model": config.model, "seed": config.trainer.seed})
    if not runs:
        raise UserError(f"--workdir {workdir}: no run has both configs/<run>.yaml and checkpoints/<run>")
    return runs


def _batches(config_path: str, split: str):
    """The held-out half `split` as a list of (tokens, loss_weight) NamedArrays, read once."""
    import haliax as hax
    import jax.numpy as jnp

    config = with_corpus(parse(TrainConfig, ["--config_path", config_path, "--corpus.eval_split", split], "train"))
    if not cache_lock.build(config.data, "validation"):
        raise UserError(f"{config_path}: no validation data for split {split}")
    evaluator = perplexity.make_evaluator(config, config.model.max_Pos, config.data.the_tokenizer)
    out = []
    for batch, _tags in evaluator.loader:
        tokens = hax.named(jnp.asarray(np.asarray(batch.tokens.array)), batch.tokens.axes)
        weight = hax.named(jnp.asarray(np.asarray(batch.loss_weight.array), jnp.float32), batch.tokens.axes)
        out.append((tokens, weight))
    return out


def _load(config_path: str, checkpoint: str):
    model, _ = load_model(parse(TrainConfig, ["--config_path", config_path], "train"), checkpoint)
    return model


def evaluate_run(run: dict, data: dict, taus: list[float], checkpoint: str) -> dict:
    model = _load(run["config_path"], checkpoint)
    out = {"run": run["run"], "seed": run["seed"], "num_layers": model.config.num_layers, "vocab": model.Vocab.size}
    if not isinstance(model, AdaptiveLMHeadModel):
        out["kind"] = "baseline"
        for split, batches in data.items():
            out[split] = ex.summary(ex.accumulate(ex.plain_sums(model, t, w) for t, w in batches))
        return out
    out["kind"] = "exits"
    out["exits"], out["threshold"] = {}, []
    for split, batches in data.items():
        out["exits"][split] = ex.summary(ex.accumulate(ex.per_exit_sums(model, t, w) for t, w in batches))
    for tau in taus:
        row = {"tau": tau}
        for split, batches in data.items():
            row[split] = ex.summary(ex.accumulate(ex.threshold_sums(model, t, w, tau) for t, w in batches))
        out["threshold"].append(row)
    return out


def choose_tau(result: dict, tolerance: float) -> dict:
    """The threshold row chosen on `selection`: lowest average exit within the loss slack (module docstring)."""
    limit = (1.0 + tolerance) * result["exits"]["selection"]["loss"][-1]
    ok = [r for r in result["threshold"] if r["selection"]["loss"] <= limit]
    if not ok:  # none within the slack: the most confident threshold
        ok = [max(result["threshold"], key=lambda r: r["tau"])]
    return min(ok, key=lambda r: (r["selection"]["avg_exit"], -r["tau"]))


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    m = math.fsum(values) / len(values)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return m, sd


def report(results: list[dict], tolerance: float, flops_vocab: int) -> dict:
    """Rows (loss, accuracy, average exit, FLOPs per token at both vocabularies), means over seeds."""
    rows: dict = {}

    def add(name, seed, avg_exit, split_scores, flops, flops_v2, tau=None):
        row = rows.setdefault(name, {"name": name, "per_seed": {}})
        row["per_seed"][str(seed)] = {"avg_exit": avg_exit, **split_scores, "flops": flops, "flops_vocab2": flops_v2}
        if tau is not None:
            row["per_seed"][str(seed)]["tau"] = tau

    for r in results:
        shape = AdaptiveGpt2Config(hidden_dim=r["d"], num_heads=r["heads"], num_layers=r["num_layers"],
                                   max_seq_len=r["context"], intermediate_dim=r["mlp"])  # fmt: skip
        costs, costs2 = ex.ExitCosts.of(shape, r["vocab"]), ex.ExitCosts.of(shape, flops_vocab)
        n_layers = r["num_layers"]
        if r["kind"] == "baseline":
            scores = {s: {"loss": r[s]["loss"], "accuracy": r[s]["accuracy"]} for s in ("selection", "test")}
            add(
                f"{n_layers}-layer model",
                r["seed"],
                float(n_layers),
                scores,
                costs.fixed(n_layers),
                costs2.fixed(n_layers),
            )
            continue
        for n in range(1, n_layers + 1):
            scores = {s: {"loss": r["exits"][s]["loss"][n - 1], "accuracy": r["exits"][s]["accuracy"][n - 1]}
                      for s in ("selection", "test")}  # fmt: skip
            add(
                f"aligned {n_layers}-exit model, exit {n}", r["seed"], float(n), scores, costs.fixed(n), costs2.fixed(n)
            )
        chosen = choose_tau(r, tolerance)
        counts = np.asarray(chosen["test"]["exit_fractions"])
        scores = {s: {"loss": chosen[s]["loss"], "accuracy": chosen[s]["accuracy"]} for s in ("selection", "test")}
        add(f"aligned {n_layers}-exit model, confidence threshold", r["seed"], chosen["test"]["avg_exit"], scores,
            ex.mean_flops(counts, costs.threshold), ex.mean_flops(counts, costs2.threshold), tau=chosen["tau"])  # fmt: skip
        add("  same exits, halting-head cost (accounting)", r["seed"], chosen["test"]["avg_exit"], scores,
            ex.mean_flops(counts, costs.halting), ex.mean_flops(counts, costs2.halting), tau=chosen["tau"])  # fmt: skip
    for row in rows.values():
        seeds = list(row["per_seed"].values())
        row["seeds"] = sorted(int(s) for s in row["per_seed"])
        for key, get in (
            ("test_loss", lambda s: s["test"]["loss"]), ("test_accuracy", lambda s: s["test"]["accuracy"]),
            ("selection_loss", lambda s: s["selection"]["loss"]), ("avg_exit", lambda s: s["avg_exit"]),
            ("flops", lambda s: s["flops"]), ("flops_vocab2", lambda s: s["flops_vocab2"]),
        ):  # fmt: skip
            row[key], row[key + "_sd"] = _mean_sd([get(s) for s in seeds])
        if "tau" in seeds[0]:
            row["taus"] = [s["tau"] for s in seeds]
    return {"rows": list(rows.values()), "tolerance": tolerance, "flops_vocab": flops_vocab,
            "vocab": results[0]["vocab"], "runs": results}  # fmt: skip


def markdown(result: dict) -> str:
    def pm(row, key, fmt):
        sd = row.get(key + "_sd")
        return f"{row[key]:{fmt}}" + ("" if sd is None else f" ± {sd:{fmt}}")

    v, v2 = result["vocab"], result["flops_vocab"]
    lines = [
        f"Test split (mean ± sd over seeds; sd shown with 2+ seeds). Thresholds chosen on the selection split: lowest "
        f"average exit with selection loss within {result['tolerance']:.0%} of the last exit's. FLOPs per token, "
        f"forward, at V={v} and (accounting only, the same exits) V={v2}.",
        "",
        f"| model | seeds | avg exit | test loss | test accuracy | MFLOPs/token (V={v}) | MFLOPs/token (V={v2}) | tau |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        tau = ", ".join(f"{t:g}" for t in row.get("taus", [])) or "-"
        lines.append(
            f"| {row['name']} | {row['seeds']} | {pm(row, 'avg_exit', '.3f')} | {pm(row, 'test_loss', '.4f')} | "
            f"{pm(row, 'test_accuracy', '.4f')} | {row['flops'] / 1e6:.3f} | {row['flops_vocab2'] / 1e6:.3f} | {tau} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=110)
    groups = {"baselines": [], "exits": [], "threshold": []}
    for row in result["rows"]:
        if "layer model" in row["name"]:
            groups["baselines"].append(row)
        elif "exit " in row["name"] and "threshold" not in row["name"]:
            groups["exits"].append(row)
    curves = [(r, c) for r in result["runs"] if r["kind"] == "exits" for c in [r["threshold"]]]
    for ax, xkey, xlabel in zip(
        axes, ("avg_exit", "flops", "flops_vocab2"),
        ("average exit (blocks)", f"MFLOPs/token, V={result['vocab']}", f"MFLOPs/token, V={result['flops_vocab']} (accounting)"),
    ):  # fmt: skip
        scale = 1.0 if xkey == "avg_exit" else 1e-6
        for label, rows, style in (
            ("n-layer models", groups["baselines"], "s-"),
            ("aligned, exit n", groups["exits"], "o-"),
        ):
            pts = sorted((r[xkey] * scale, r["test_loss"]) for r in rows)
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        for run, rows_t in curves:  # the whole tau grid on the test split (the chosen tau is starred)
            shape = AdaptiveGpt2Config(hidden_dim=run["d"], num_heads=run["heads"], num_layers=run["num_layers"],
                                       max_seq_len=run["context"], intermediate_dim=run["mlp"])  # fmt: skip
            vocab = run["vocab"] if xkey == "flops" else result["flops_vocab"]
            costs = ex.ExitCosts.of(shape, vocab)
            xs = [
                t["test"]["avg_exit"] if xkey == "avg_exit" else ex.mean_flops(t["test"]["exit_fractions"], costs.threshold) * scale
                for t in rows_t
            ]  # fmt: skip
            ax.plot(xs, [t["test"]["loss"] for t in rows_t], "^:", alpha=0.7, label=f"threshold, seed {run['seed']}")
        for row in result["rows"]:
            if "threshold" in row["name"]:
                ax.plot(
                    row[xkey] * scale, row["test_loss"], "*", markersize=14, color="k", label="chosen tau (selection)"
                )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test loss (nats/char)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    axes[0].legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]) -> int:
    import haliax as hax  # noqa: F401  (JAX before timing)

    args = _parser().parse_args(argv)
    try:
        taus = [float(t) for t in args.taus.split(",")]
    except ValueError:
        raise UserError(f"--taus {args.taus!r} is invalid: expected comma-separated numbers in (0, 1)") from None
    if not all(0 < t < 1 for t in taus):
        raise UserError(f"--taus {args.taus!r} is invalid: expected comma-separated numbers in (0, 1)")
    workdir = Path(args.workdir).resolve()
    files = {ext: Path(args.out_dir) / f"{args.name}.{ext}" for ext in ("json", "md", "png")}
    for path in files.values():
        outputs.check_file(path, "--out_dir", overwrite=args.overwrite)
    runs = _runs(workdir)
    start = time.perf_counter()
    data = {split: _batches(runs[0]["config_path"], split) for split in ("selection", "test")}
    results = []
    for run in runs:
        print(f"bench exits: {run['run']}", flush=True)
        r = evaluate_run(run, data, taus, str(workdir / "checkpoints" / run["run"]))
        m = run["model"]
        r.update(d=m.hidden_dim, heads=m.num_heads, context=m.max_seq_len, mlp=m.mlp_dim)
        results.append(r)
    result = report(results, args.tolerance, args.flops_vocab)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    table = markdown(result)
    outputs.write_file(files["json"], "--out_dir", json.dumps(result, indent=1) + "\n", overwrite=args.overwrite)
    outputs.write_file(files["md"], "--out_dir", table, overwrite=args.overwrite)
    with outputs.writing_file(files["png"], "--out_dir", overwrite=args.overwrite) as tmp:
        plot(result, tmp)
    print(table)
    print(f"wrote {Path(args.out_dir) / args.name}.{{md,json,png}}")
    return 0
