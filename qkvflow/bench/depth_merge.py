"""`qkvflow bench depth A_depth.json B_depth.json ... --out_dir D`: the depth curves of several `bench compare`
studies on one corpus, as one report with every model.

Each `NAME_depth.json` a study with a `depth:` section writes (qkvflow.bench.comparison.depth_curves) holds, per ODE
model, its test loss at every grid and the loss minus the loss at the trained grid, paired over seeds.
Screens of different recipes usually share the baseline model (the same runs, or runs of the same config
and seed elsewhere). Merging them:

- every report must have the same budget (`iters`) and seeds;
- a model found in several reports is the same model only if its mean test loss agrees within
  `--tolerance` nats at every grid the reports share (else it is refused: two models under one name);
  its rows are the union of the reports' grids, the first report's row where they overlap;
- the figure plots each grid's loss minus the trained grid's (paired interval) against vector-field
  evaluations, one panel per solver, one colour per model, with the issue-33 targets marked
  (+0.01 nats at 2N and 4N): a model whose curve stays at 0 runs at any depth.

Writes D/NAME.json, .md (qkvflow.bench.comparison.depth_curves.markdown) and .png; D is checked and replaced as every
qkvflow output is (qkvflow.outputs).
"""

import argparse
import json
from pathlib import Path

from qkvflow import outputs
from qkvflow.bench.comparison import depth_curves
from qkvflow.errors import UserError

KIND = "bench depth report"
SOLVER_ORDER = ("euler", "midpoint", "ralston", "heun", "rk4", "tsit5", "dopri5")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvflow bench depth", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="NAME_depth.json files written by `qkvflow bench compare`")
    p.add_argument(
        "--out_dir",
        required=True,
        help="a folder for the merged report (absent, empty, or an earlier one with --overwrite)",
    )
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--name", default="depth_all", help="file name of the report (default: depth_all)")
    p.add_argument("--title", default=None, help="the report's title (default: the first report's)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="nats within which a shared model must agree")
    return p


def _load(path: str) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read a depth report ({type(e).__name__}): expected a NAME_depth.json") from e
    if (
        not isinstance(report, dict)
        or not {"models", "iters", "seeds"} <= set(report)
        or not isinstance(report["models"], dict)
    ):
        raise UserError(f"{path}: not a bench compare depth report: expected the keys models, iters and seeds")
    return report


def merge(reports: dict, tolerance: float = 1e-3, title=None) -> dict:
    """One report from {path: depth report}, in the given order (see the module docstring)."""
    paths = list(reports)
    first = reports[paths[0]]
    models, sources, origin = {}, {}, {}  # origin: (model, solver, grid) -> the report its row came from
    for path, report in reports.items():
        for key in ("iters", "seeds"):
            if report[key] != first[key]:
                raise UserError(
                    f"{path}: {key}={report[key]!r}, but {paths[0]} has {first[key]!r}: "
                    "merge reports of one budget and one set of seeds"
                )
        for model, rows in report["models"].items():
            held = {(r["solver"], r["grid"]): r for r in models.setdefault(model, [])}
            for row in rows:
                key = (row["solver"], row["grid"])
                if key not in held:
                    models[model].append(row)
                    origin[(model, *key)] = path
                elif abs(row["loss"]["mean"] - held[key]["loss"]["mean"]) > tolerance:
                    raise UserError(
                        f"{path}: model {model!r} at {key[0]} {key[1]} has test loss {row['loss']['mean']:.4f}, "
                        f"{held[key]['loss']['mean']:.4f} in {origin[(model, *key)]}: more than "
                        f"--tolerance={tolerance} apart, so not the same model; rename one"
                    )
            sources.setdefault(model, []).append(path)
    return {
        "title": title or first.get("title", "depth curves"), "iters": first["iters"], "seeds": first["seeds"],
        "sources": paths, "tolerance": tolerance, "model_sources": sources, "models": models,
    }  # fmt: skip


def plot_deltas(result: dict, path) -> None:
    """Loss minus the trained grid's against evaluations, one panel per solver (log x, symmetric-log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    present = {r["solver"] for rows in result["models"].values() for r in rows}
    solvers = [s for s in SOLVER_ORDER if s in present] + sorted(present - set(SOLVER_ORDER))
    fig, axes = plt.subplots(1, len(solvers), figsize=(4.2 * len(solvers), 4.6), dpi=110, sharey=True, squeeze=False)
    colours = plt.get_cmap("tab20")
    for ax, solver in zip(axes[0], solvers):
        ticks = set()  # the evaluation counts this solver was run at, labelled as they are
        for i, (model, rows) in enumerate(result["models"].items()):
            points = sorted((r for r in rows if r["solver"] == solver and r["nfe"]), key=lambda r: r["nfe"])
            if not points:
                continue
            ticks |= {r["nfe"] for r in points}
            y = [r["minus_trained"]["mean"] for r in points]
            bars = [[0.0, 0.0] if r["minus_trained"]["ci95"] is None else
                    [m - r["minus_trained"]["ci95"][0], r["minus_trained"]["ci95"][1] - m] for r, m in zip(points, y)]  # fmt: skip
            ax.errorbar([r["nfe"] for r in points], y, yerr=list(zip(*bars)), color=colours(i % 20), marker="o",
                        markersize=3, capsize=2, lw=1, label=model)  # fmt: skip
        ax.axhline(0.0, color="black", lw=0.8)
        ax.axhline(0.01, color="grey", lw=0.8, ls=":", label="+0.01 (2N, 4N target)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_xlabel("vector-field evaluations per forward pass")
        ax.set_title(solver, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test loss minus loss at the trained grid (nats)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # models missing from the first panel
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, fontsize=6, loc="lower center", ncol=min(len(labels), 6))
    fig.suptitle(f"{result['title']}: {result['iters']} steps, seeds {result['seeds']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * (len(labels) // 6), 1, 0.96))
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    protect = [("a report it reads", p) for p in args.reports]
    rules = {"kind": KIND, "key": "--out_dir", "overwrite": args.overwrite, "protect": protect}
    outputs.check_replaceable(args.out_dir, **rules)  # before any work, as every output
    outputs.check_writable(args.out_dir, "--out_dir", beside=True)
    result = merge({p: _load(p) for p in args.reports}, args.tolerance, args.title)
    table = depth_curves.markdown(result)
    with outputs.replacing(args.out_dir, **rules) as folder:
        Path(folder, f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        Path(folder, f"{args.name}.md").write_text(table)
        plot_deltas(result, Path(folder, f"{args.name}.png"))
    print(table)
    for ext in ("json", "md", "png"):
        print(f"bench depth: wrote {Path(args.out_dir) / f'{args.name}.{ext}'}", flush=True)
    return 0
