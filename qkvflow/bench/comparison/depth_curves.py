"""Depth curves of a `bench compare` study: each chosen run evaluated at many solver grids.

A study with a `depth:` section (benchmarks/compare/depth_dial.yaml) evaluates every chosen run of an ODE
model on the test split at each grid of `qkvflow eval --steps S --solver V --tolerances T`
(qkvflow.evaluation.depth; S may be relative to the trained N, e.g. N/4,N/2,N,2N,4N). Per model and grid:

- the test loss, mean over seeds and its 95% Student-t interval (qkvflow.bench.comparison.stats);
- the loss minus the loss at the trained grid, paired over seeds (same run, other grid), with its
  interval: the depth dial works where it is <= 0 for the finer grids;
- the vector-field evaluations (mean over seeds: adaptive solves measure theirs).

Written beside the study's report as NAME_depth.json, .md and .png (test loss against evaluations,
log x, one colour per model, one marker per solver, bars the 95% interval).
"""

from typing import Optional

from qkvflow.bench.comparison import stats
from qkvflow.errors import UserError

KEYS = {"steps": "--steps", "solver": "--solver", "tolerances": "--tolerances"}


def check(depth, path: str) -> dict:
    """The study's `depth:` mapping (string values, keys among steps, solver, tolerances), or a UserError."""
    ok = isinstance(depth, dict) and depth and set(depth) <= set(KEYS)
    if not ok or not all(isinstance(v, (str, int, float)) for v in depth.values()):
        raise UserError(
            f"bench compare: {path}: depth={depth!r} is invalid: expected a mapping with keys among {sorted(KEYS)} "
            "and `qkvflow eval` values, e.g. {steps: 'N/2,N,2N', solver: 'euler,rk4', tolerances: '1e-2,1e-3'}"
        )
    return {k: str(v) for k, v in depth.items()}


def eval_args(depth: Optional[dict]) -> list[str]:
    """The `qkvflow eval` options of the study's grids."""
    args = []
    for key, value in (depth or {}).items():
        args += [KEYS[key], value]
    return args


def trained_row(rows: list[dict]) -> dict:
    """The row at the run's own solve (the only row without grids)."""
    if len(rows) == 1:
        return rows[0]
    trained = [r for r in rows if r.get("trained")]
    if len(trained) != 1:
        raise UserError("bench compare: the depth table has no single row at the trained grid; add N to depth.steps")
    return trained[0]


def _interval(values: dict) -> dict:
    """Mean and 95% interval of the per-seed values (the interval of a difference from 0)."""
    d = stats.paired_difference(values, {seed: 0.0 for seed in values})
    return {"mean": d.mean, "ci95": None if d.low is None else [d.low, d.high]}


def summarise(rows_by_seed: dict) -> list[dict]:
    """One entry per grid from {seed: depth.json rows}, in the order of the first seed's rows."""
    trained = {seed: trained_row(rows)["loss"] for seed, rows in rows_by_seed.items()}
    first = next(iter(rows_by_seed.values()))
    out = []
    for row in first:
        key = (row["solver"], row["grid"])
        per_seed = {s: next(r for r in rows if (r["solver"], r["grid"]) == key) for s, rows in rows_by_seed.items()}
        nfe = [r["nfe"] for r in per_seed.values() if r.get("nfe") is not None]
        out.append({
            "solver": row["solver"], "grid": row["grid"], "steps": row.get("steps"), "tolerance": row.get("tolerance"),
            "trained": bool(row.get("trained")), "nfe": sum(nfe) / len(nfe) if nfe else None,
            "loss": _interval({s: r["loss"] for s, r in per_seed.items()}),
            "minus_trained": _interval({s: r["loss"] - trained[s] for s, r in per_seed.items()}),
        })  # fmt: skip
    return out


def markdown(result: dict) -> str:
    def ci(entry):
        return "-" if entry["ci95"] is None else f"[{entry['ci95'][0]:+.4f}, {entry['ci95'][1]:+.4f}]"

    lines = [
        f"{result['title']}: test loss at each grid, mean over seeds {result['seeds']} [95% interval]; "
        "Δ = loss minus the loss at the trained grid, paired over seeds.",
        "",
        "| model | solver | grid | evaluations | test loss | 95% interval | Δ to trained grid | Δ 95% interval |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, grids in result["models"].items():
        for g in grids:
            nfe = "-" if g["nfe"] is None else f"{g['nfe']:.1f}"
            mark = " (trained)" if g["trained"] else ""
            lines.append(
                f"| {model} | {g['solver']} | {g['grid']}{mark} | {nfe} | {g['loss']['mean']:.4f} | {ci(g['loss'])} | "
                f"{g['minus_trained']['mean']:+.4f} | {ci(g['minus_trained'])} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"euler": "o", "heun": "s", "midpoint": "v", "ralston": "^", "rk4": "D", "tsit5": "*", "dopri5": "P"}
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for i, (model, grids) in enumerate(result["models"].items()):
        colour = f"C{i % 10}"
        for solver in dict.fromkeys(g["solver"] for g in grids):
            points = sorted((g for g in grids if g["solver"] == solver and g["nfe"]), key=lambda g: g["nfe"])
            if not points:
                continue
            x = [g["nfe"] for g in points]
            y = [g["loss"]["mean"] for g in points]
            err = [[0.0, 0.0] if g["loss"]["ci95"] is None else [y - g["loss"]["ci95"][0], g["loss"]["ci95"][1] - y]
                   for g, y in zip(points, y)]  # fmt: skip
            ax.errorbar(x, y, yerr=list(zip(*err)), color=colour, marker=markers.get(solver, "x"), markersize=4,
                        capsize=2, lw=1, label=f"{model} {solver}")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("vector-field evaluations per forward pass")
    ax.set_ylabel("test loss (nats/token)")
    ax.set_title(f"{result['title']}: {result['iters']} steps, depth at inference", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
