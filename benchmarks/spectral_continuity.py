"""Spectral continuity (the paper's Appendix E): do the DiffEqFormer's QK and OV spectra vary more smoothly
over depth than a same-shape GPT-2's between its layers?

Reads the trained checkpoints of a `qkvflow bench compare ... --keep_checkpoints` study (each model at its
chosen learning rate, every seed) and computes, with `qkvflow analyze spectra`'s functions, the relative
variation V of the sorted real parts of the eigenvalues (qkvflow/analysis/spectra.py):

- GPT-2: between its layers (K = number of layers);
- DiffEqFormer: at the K times its fixed-grid solve evaluates W(t) (where training shaped the weights),
  the like-for-like comparison; and between grid points: the path length (K - 1) V over 61 evenly spaced
  times divided by that over 4 (0, 1/3, 2/3, 1 are among the 61, so the ratio is >= 1 up to the change of
  scale; near 1 means no wiggles between the coarse points).

The claim is read from the paired difference V(DiffEqFormer) - V(GPT-2) over seeds (qkvflow/bench/comparison/stats.py).

    PYTHONPATH=. python benchmarks/spectral_continuity.py --workdir W --report R.json --out benchmarks/results/NAME

W is the study's --workdir, R its report JSON (which names each model's chosen learning rate and the seeds).
"""

import argparse
import json
import os
import sys

from qkvflow.analysis.spectra import analyze_spectra
from qkvflow.bench.comparison import stats
from qkvflow.bench.comparison.study import run_id
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.configfile import CONFIG_PATH, parse
from qkvflow.runs.model import load_model

FINE = 61  # evenly spaced times that include 0, 1/3, 2/3 and 1


def _model(workdir: str, rid: str):
    config = parse(TrainConfig, [CONFIG_PATH, os.path.join(workdir, "configs", f"{rid}.yaml")], "analyze")
    model, _ = load_model(config, os.path.join(workdir, "checkpoints", rid))
    return model


def measure(workdir: str, report: dict, baseline: str, ode: str, out: str) -> dict:
    rows = {}
    for name in (baseline, ode):
        lr = report["models"][name]["best_learning_rate"]
        for seed in report["seeds"]:
            rid = run_id(name, lr, seed)
            model = _model(workdir, rid)
            where = os.path.join(out, rid)
            if name == baseline:
                coarse = analyze_spectra(model, where)
                row = {key: coarse[f"{key}_relative_variation"] for key in ("qk", "ov")}
            else:
                coarse = analyze_spectra(model, os.path.join(where, "solver_times"), at_solver_times=True)
                even = analyze_spectra(model, os.path.join(where, "even_4"), num_times=4)
                fine = analyze_spectra(model, os.path.join(where, f"even_{FINE}"), num_times=FINE)
                row = {key: coarse[f"{key}_relative_variation"] for key in ("qk", "ov")}
                for key in ("qk", "ov"):
                    path_fine = (FINE - 1) * fine[f"{key}_relative_variation"]
                    path_even = 3 * even[f"{key}_relative_variation"]
                    row[f"{key}_path_ratio_{FINE}_to_4"] = path_fine / path_even
            row["points"] = coarse["points"]
            rows.setdefault(name, {})[seed] = row
            print(json.dumps({"run": rid, **row}), flush=True)
    result = {"workdir": workdir, "baseline": baseline, "ode": ode, "seeds": report["seeds"], "runs": rows}
    for key in ("qk", "ov"):
        d = stats.paired_difference(
            {s: r[key] for s, r in rows[ode].items()}, {s: r[key] for s, r in rows[baseline].items()}
        )
        result[f"{key}_difference"] = {"mean": d.mean, "ci95": [d.low, d.high], "verdict": d.verdict}
    return result


def markdown(result: dict) -> str:
    b, o = result["baseline"], result["ode"]
    lines = [
        f"Relative variation V of the sorted real eigenvalue parts over depth, seeds {result['seeds']}: {b} between "
        f"its layers, {o} at its solver's times (the same number of points).",
        "",
        "| circuit | V " + b + " (mean ± sd) | V " + o + " (mean ± sd) | Δ [95% CI] | verdict | "
        f"{o} path ratio {FINE}:4 (mean, range) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for key in ("qk", "ov"):
        sb = stats.summarise([r[key] for r in result["runs"][b].values()])
        so = stats.summarise([r[key] for r in result["runs"][o].values()])
        ratio = [r[f"{key}_path_ratio_{FINE}_to_4"] for r in result["runs"][o].values()]
        d = result[f"{key}_difference"]
        lo, hi = d["ci95"]
        interval = "-" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"
        lines.append(
            f"| {key.upper()} | {sb.mean:.3f} ± {sb.std or 0:.3f} | {so.mean:.3f} ± {so.std or 0:.3f} "
            f"| {d['mean']:+.3f} {interval} | {d['verdict']} | {sum(ratio) / len(ratio):.2f} "
            f"({min(ratio):.2f}-{max(ratio):.2f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="the compare study's --workdir (run with --keep_checkpoints)")
    p.add_argument("--report", required=True, help="the study's report JSON (chosen learning rates, seeds)")
    p.add_argument("--baseline", default="gpt2")
    p.add_argument("--ode", default="ode")
    p.add_argument("--out", required=True, help="folder for the per-run figures, result.json and result.md")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    result = measure(args.workdir, report, args.baseline, args.ode, args.out)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(result)
    with open(os.path.join(args.out, "result.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
