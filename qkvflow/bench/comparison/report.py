"""The report of `qkvflow bench compare`: NAME.json, a markdown table NAME.md and a figure NAME.png.

Per model: the chosen peak learning rate (marked "at the grid's edge" when it is the lowest or highest
of a grid of two or more rates: qkvflow.bench.comparison.lr_grid), the selection losses per rate, the test losses
per seed with their mean and standard deviation, the paired 95% interval of the difference to the
baseline (qkvflow.bench.comparison.stats), the parameter count, the training FLOPs, and for a matched model
(qkvflow.bench.comparison.matching) the achieved ratio of its measure to its target's, taken from this report's
own rows where the target is one (else from the solve), marked when outside `matching.TOLERANCE`.
"""

import os
from pathlib import Path
from typing import Optional

from qkvflow.bench.comparison import depth_curves, matching, stats
from qkvflow.bench.comparison.study_folder import write_json

EDGE = "at the grid's edge"
REPORT_FIELDS = {"params": "parameter_count", "train_flops": "training_flops"}
"""The row field holding each matched measure."""


def report(study: dict, runs: list[dict], tests: dict, flops: dict, chosen: dict) -> dict:
    """The report's data; `chosen[model]` holds the chosen `learning_rate`, the `grid` it was chosen from,
    the rates `--extend_grid` `added`, the grid's `edge` side of the choice (or None), and whether the
    extension stopped at its limit with the choice still at the edge (`limit_reached`)."""
    models = {}
    for model in study["models"]:
        mine = [r for r in runs if r["model"] == model]
        by_lr = {}
        for r in mine:
            by_lr.setdefault(r["learning_rate"], {})[r["seed"]] = r["selection_loss"]
        test, choice = tests[model], chosen[model]
        s = stats.summarise(test.values())
        models[model] = {
            "best_learning_rate": choice["learning_rate"],
            "learning_rates": choice["grid"],
            "edge": choice["edge"],
            "added_learning_rates": choice["added"],
            "extend_limit_reached": choice["limit_reached"],
            "selection": {f"{lr:g}": stats.summarise(v.values()).__dict__ for lr, v in sorted(by_lr.items())},
            "test": {"per_seed": {str(k): v for k, v in sorted(test.items())}, **s.__dict__},
            "parameter_count": next((r["parameter_count"] for r in mine if r["parameter_count"]), None),
            "training_flops": flops[model],
            "wall_s": round(sum(r["wall_s"] for r in mine), 1),
        }
    for model, found in study.get("matched", {}).items():
        models[model]["match"] = _achieved(found, models[model], models.get(found["target"]))
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


def _achieved(found: dict, row: dict, target_row: Optional[dict]) -> dict:
    """A matched row's ratio: from the report's rows when both have the measure, else the solve's."""
    field = REPORT_FIELDS[found["measure"]]
    mine, theirs = row[field], (target_row or {}).get(field)
    from_rows = mine is not None and theirs
    ratio = mine / theirs if from_rows else found["ratio"]
    return {"measure": found["measure"], "target": found["target"], "solved": found["solved"],
            "vocab_size": found["vocab_size"], "ratio": ratio, "ratio_from": "report" if from_rows else "accounting",
            "within": matching.within(ratio)}  # fmt: skip


def markdown(result: dict) -> str:
    def f(x, digits=4):
        return "-" if x is None else f"{x:.{digits}f}"

    rows = result["models"]
    grids = "".join(
        f"; {m} from {e['learning_rates']}" for m, e in rows.items() if e["learning_rates"] != result["learning_rates"]
    )
    matched = any("match" in m for m in rows.values())
    lines = [
        f"{result.get('title') or result['study']}: {result['iters']} steps, seeds {result['seeds']}, peak lr chosen from "
        f"{result['learning_rates']}{grids} on the selection split; test split below. Baseline: {result['baseline']}.",
        "",
        "| model | params | train FLOPs |" + " matched |" * matched
        + " best lr | test loss (mean ± sd) | Δ to baseline [95% CI] | verdict |",
        "|---|---:|---:|" + "---|" * matched + "---:|---:|---:|---|",
    ]  # fmt: skip
    for name, m in rows.items():
        t, d = m["test"], m.get("difference_to_baseline")
        diff = "-" if d is None else f"{d['mean']:+.4f} [{f(d['ci95'][0])}, {f(d['ci95'][1])}]"
        flops = "-" if m["training_flops"] is None else f"{m['training_flops']:.3g}"
        params = "-" if m["parameter_count"] is None else f"{m['parameter_count'] / 1e6:.2f}M"
        lr = f"{m['best_learning_rate']:g}" + (f" ({EDGE})" if m["edge"] else "")
        match = f" {_matched_cell(m.get('match'))} |" if matched else ""
        lines.append(
            f"| {name} | {params} | {flops} |{match} {lr} | {f(t['mean'])} ± {f(t['std'])} | {diff} | "
            f"{'baseline' if d is None else d['verdict']} |"
        )
    lines += _notes(rows)
    return "\n".join(lines) + "\n"


def _matched_cell(match: Optional[dict]) -> str:
    if match is None:
        return "-"
    low, high = matching.TOLERANCE
    outside = "" if match["within"] else f" (outside {low}-{high})"
    return f"{match['measure']} {match['ratio']:.3f}x {match['target']}{outside}"


def _notes(rows: dict) -> list[str]:
    """Lines under the table: the models whose choice is at the grid's edge, and what was added to grids."""
    notes = []
    edges = [f"{m} ({e['edge']} of {e['learning_rates']})" for m, e in rows.items() if e["edge"]]
    if edges:
        notes.append(
            f"\nChosen learning rate {EDGE}: {', '.join(edges)}. A rate beyond it may be better, so these rows are not "
            "settled; `--extend_grid` adds the next rate (x2 or /2) and chooses again."
        )
    added = [f"{m} {e['added_learning_rates']}" for m, e in rows.items() if e["added_learning_rates"]]
    if added:
        stopped = [m for m, e in rows.items() if e["extend_limit_reached"]]
        limit = f" Stopped at the limit, still at the edge: {', '.join(stopped)}." if stopped else ""
        notes.append(f"\nAdded by --extend_grid: {', '.join(added)}.{limit}")
    return notes


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


def write_report(folder: Path, name: str, result: dict, table: str, curves: Optional[dict] = None) -> list[Path]:
    """NAME.json, NAME.md and NAME.png in `folder`, each written whole (a temporary file, then renamed),
    and with `curves` (a study's `depth:` section) NAME_depth.json, .md and .png beside them."""
    paths = _write_three(folder, name, result, table, plot)
    if curves is not None:
        paths += _write_three(folder, f"{name}_depth", curves, depth_curves.markdown(curves), depth_curves.plot)
    return paths


def _write_three(folder: Path, name: str, data: dict, table: str, plot_fn) -> list[Path]:
    paths = [folder / f"{name}.{ext}" for ext in ("json", "md", "png")]
    write_json(paths[0], data)
    tmp = paths[1].with_suffix(".md.tmp")
    tmp.write_text(table)
    os.replace(tmp, paths[1])
    tmp = folder / f".{name}.tmp.png"
    plot_fn(data, tmp)
    os.replace(tmp, paths[2])
    return paths
