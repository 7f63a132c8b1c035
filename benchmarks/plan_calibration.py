"""Refit `qkvflow plan`'s step-time calibration from measured device rows and their compiled steps.

    python benchmarks/plan_calibration.py features --rows benchmarks/results/2026-11-29_plan_calibration/rows.json
                      # the gpu extra is not needed; reads hlo/<commit>/<tag>.hlo.txt.gz beside rows.json
    python benchmarks/plan_calibration.py fit --rows benchmarks/results/2026-11-29_plan_calibration/rows.json \
        [--write]         # prints the leave-out tables; --write updates qkvflow/plan/calibrations/<target>.json
    python benchmarks/plan_calibration.py apply --plan DIR/ode.plan.json ...   # plans made before the calibration

`rows.json` lists the device rows: for each, the commit that ran it, the config, batch and model (`ode` or
`baseline`), the device's speed JSON (the measured median step time is read from it, never typed), and
the `pair` it forms with the other model. `features` computes each row's features from the optimised HLO
of that commit's step (`benchmarks/calibration_compile.py` writes it) with `qkvflow.plan.calibration.features`
and stores them, small, beside rows.json (`features.json`); `fit` needs only that file.

To add a device run: compile the step it timed at its commit (`calibration_compile.py`, PYTHONPATH = a
worktree of that commit), add its rows to rows.json, run `features` then `fit` (first without `--write`:
the fit before the new rows predicts them, which is how well the old calibration held) and `fit --write`.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from qkvflow.plan import calibration, hlo, targets

ROOT = Path(__file__).resolve().parents[1]

CANDIDATES = {
    "a roofline": ("roofline_s",),
    "a roofline + c launches": ("roofline_s", "launches"),
    "a roofline + c syncs": ("roofline_s", "host_syncs"),
    "a roofline + c launches + c syncs": ("roofline_s", "launches", "host_syncs"),
    "per-kind a (gemm, attention, other)": ("gemm_s", "attention_s", "other_s"),
}
"""The models compared in `fit`; the shipped one is calibration.FEATURES."""


def measured(row: dict) -> dict:
    """The median step time (s) and its spread for `row` from the device's speed JSON."""
    data = json.loads((ROOT / row["measured_json"]).read_text())
    for run in data.get("runs", [data]):
        if run["config"]["batch"] == row["batch"]:
            t = run[row["model"]]["step_time_s"]
            return {"measured_s": t["median"], "min_s": t["min"], "max_s": t["max"], "n": t["n"],
                    "device": run["device"]["kind"], "jax": run["device"]["jax"]}  # fmt: skip
    raise SystemExit(f"{row['measured_json']}: no run at batch {row['batch']}")


def cmd_features(args) -> int:
    spec = json.loads(Path(args.rows).read_text())
    target = targets.get(spec["target"])
    out = []
    for row in spec["rows"]:
        tag = f"{Path(row['config']).stem}_b{row['batch']}_{row['model']}"
        folder = Path(args.hlo_dir or Path(args.rows).parent / "hlo") / row["commit"]
        plain = folder / f"{tag}.hlo.txt"
        text = (
            plain.read_text()
            if plain.is_file()
            else gzip.decompress((folder / f"{tag}.hlo.txt.gz").read_bytes()).decode()
        )
        compiled = json.loads((folder / f"{tag}.json").read_text())
        trips = int(row.get("ode_num_steps") or 1)
        feats = calibration.features(hlo.parse(text), target, unknown_trip_count=trips)
        out.append({**row, **measured(row), "features": feats, "compiled": {
            "jax": compiled["jax"], "xla_memory_total": compiled["xla_memory"]["total_bytes"],
            "measured_xla_memory_total": (compiled.get("measured_xla_memory") or {}).get("total_bytes"),
            "compile_s": compiled["compile_s"]}})  # fmt: skip
        print(row["name"], json.dumps(feats), file=sys.stderr)
    path = Path(args.rows).with_name("features.json")
    path.write_text(json.dumps({"target": spec["target"], "scope": spec["scope"], "rows": out}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def flat(row: dict) -> dict:
    """`row` with the per-kind roofline seconds as features of their own (for CANDIDATES)."""
    f = dict(row["features"])
    for kind, s in f.pop("roofline_by_kind_s").items():
        f[f"{kind}_s"] = s or 0.0
    return {**row, "features": f}


def table(rows: list[dict], names) -> dict:
    """Leave-one-out and leave-pair-out predictions of `rows`, their pairs' ratios, and the worst errors."""
    out = {}
    for kind, method in (("loo", calibration.leave_one_out), ("lpo", calibration.leave_pair_out)):
        pred = method(rows, names)
        ratios = calibration.pair_ratios(rows, [r["predicted_s"] for r in pred])
        worst = {"step": max(abs(r["error"]) for r in pred), "ratio": max(abs(r["error"]) for r in ratios)}
        out[kind] = {"rows": pred, "ratios": ratios, "worst": worst}
    return out


def cmd_fit(args) -> int:
    data = json.loads(Path(args.rows).with_name("features.json").read_text())
    rows = [flat(r) for r in data["rows"] if r.get("fit", True)]
    held = [flat(r) for r in data["rows"] if not r.get("fit", True)]
    print(f"{len(rows)} rows fitted, {len(held)} held out; worst |error| per model, leave-one-out; leave-pair-out:")
    for label, names in CANDIDATES.items():
        t = table(rows, names)
        coef = calibration.fit(rows, names)
        loo, lpo = t["loo"]["worst"], t["lpo"]["worst"]
        print(f"  {label:<38} step {loo['step']:6.1%}, ratio {loo['ratio']:.3f}; step {lpo['step']:6.1%}, "
              f"ratio {lpo['ratio']:.3f}  " + ", ".join(f"{n}={v:.4g}" for n, v in coef.items()))  # fmt: skip
    names = calibration.FEATURES
    coef = calibration.fit(rows, names)
    t = table(rows, names)
    loo, lpo = t["loo"], t["lpo"]
    full = [calibration.predict(coef, r["features"]) for r in rows]
    print("\n| row | commit | measured (ms) | roofline (ms) | measured / roofline | calibrated, all rows (ms) "
          "| leave-one-out (ms) | leave-one-out error | leave-pair-out (ms) | leave-pair-out error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r, p, o, q in zip(rows, full, loo["rows"], lpo["rows"]):
        f = r["features"]
        print(f"| {r['name']} | {r['commit']} | {r['measured_s'] * 1e3:.1f} | {f['roofline_s'] * 1e3:.1f} | "
              f"{r['measured_s'] / f['roofline_s']:.2f} | {p * 1e3:.1f} | {o['predicted_s'] * 1e3:.1f} | "
              f"{o['error']:+.1%} | {q['predicted_s'] * 1e3:.1f} | {q['error']:+.1%} |")  # fmt: skip
    print("\n| pair | measured ODE/GPT-2 | roofline | leave-one-out | error | leave-pair-out | error |")
    print("|---|---|---|---|---|---|---|")
    roof = calibration.pair_ratios(rows, [r["features"]["roofline_s"] for r in rows])
    for a, b, r0 in zip(loo["ratios"], lpo["ratios"], roof):
        print(f"| {a['pair']} | {a['measured']:.3f} | {r0['predicted']:.3f} | {a['predicted']:.3f} | "
              f"{a['error']:+.3f} | {b['predicted']:.3f} | {b['error']:+.3f} |")  # fmt: skip
    for r in held:
        p = calibration.predict(coef, r["features"])
        print(f"held out: {r['name']} ({r['commit']}): measured {r['measured_s'] * 1e3:.1f} ms "
              f"[{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}, n={r['n']}], predicted {p * 1e3:.1f} ms "
              f"({p / r['measured_s'] - 1:+.1%})")  # fmt: skip
    for q in calibration.pair_ratios(held, [calibration.predict(coef, r["features"]) for r in held]):
        print(f"held out pair {q['pair']}: measured {q['measured']:.3f}, predicted {q['predicted']:.3f} "
              f"({q['error']:+.3f})")  # fmt: skip
    band = max(loo["worst"]["step"], lpo["worst"]["step"])
    print(f"\ncoefficients: {coef}\nworst leave-one-out: step {loo['worst']['step']:.1%}, ratio "
          f"{loo['worst']['ratio']:.3f}; leave-pair-out: step {lpo['worst']['step']:.1%}, ratio "
          f"{lpo['worst']['ratio']:.3f}; band {band:.1%}")  # fmt: skip
    if args.write:
        record = {
            "target": data["target"],
            "model": "t_step = " + " + ".join(f"c[{n}] * {n}" for n in names),
            "coefficients": coef,
            "band": round(band, 4),
            "band_is": "the rows' worst |error| under leave-one-out and leave-pair-out",
            "ratio_error": round(max(loo["worst"]["ratio"], lpo["worst"]["ratio"]), 4),
            "source": Path(args.rows).resolve().parent.relative_to(ROOT).as_posix(),
            "scope": data["scope"],
            "rows": [{"name": r["name"], "commit": r["commit"], "config": r["config"], "model": r["model"],
                      "pair": r["pair"], "batch": r["batch"], "measured_s": r["measured_s"],
                      "features": {n: r["features"][n] for n in names},
                      "loo_predicted_s": o["predicted_s"], "loo_error": o["error"],
                      "lpo_predicted_s": q["predicted_s"], "lpo_error": q["error"]}
                     for r, o, q in zip(rows, loo["rows"], lpo["rows"])],
            "loo_ratios": loo["ratios"],
            "lpo_ratios": lpo["ratios"],
        }  # fmt: skip
        path = calibration.DATA / f"{data['target']}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


def cmd_apply(args) -> int:
    """The calibrated estimate of plans already made: each `--plan` JSON (`qkvflow plan --json`) with
    the HLO saved beside it (`--save_hlo`), `<name>.plan.json` and `<name>.hlo.txt[.gz]`."""
    for path in args.plan:
        p = json.loads(Path(path).read_text())
        base = Path(path).with_name(Path(path).name.replace(".plan.json", ".hlo.txt"))
        text = base.read_text() if base.is_file() else gzip.decompress(Path(f"{base}.gz").read_bytes()).decode()
        target = targets.get(p["target"])
        trips = p["estimate"].get("unknown_trip_counts_taken_as", 1)
        feats = calibration.features(hlo.parse(text), target, unknown_trip_count=trips)
        peak = target.peak_flops.get(p["compute_dtype"])
        c = calibration.calibrated(feats, target.name, p["estimate"]["model_flops"], peak)
        if not c["calibrated"]:
            print(f"{path}: {c['why']}")
            continue
        print(f"{path}: roofline {feats['roofline_s'] * 1e3:.1f} ms, calibrated {c['step_s'] * 1e3:.1f} ms "
              f"[{c['low_s'] * 1e3:.1f}-{c['high_s'] * 1e3:.1f}], MFU {c['mfu']:.1%} "
              f"(launches {feats['launches']}, host syncs {feats['host_syncs']})")  # fmt: skip
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("features")
    f.add_argument("--rows", required=True)
    f.add_argument("--hlo_dir", default=None, help="<commit>/<tag>.hlo.txt[.gz] and .json; default: hlo/ beside --rows")
    g = sub.add_parser("fit")
    g.add_argument("--rows", required=True)
    g.add_argument("--write", action="store_true")
    a = sub.add_parser("apply")
    a.add_argument("--plan", nargs="+", required=True)
    args = p.parse_args(argv)
    np.set_printoptions(precision=4)
    return {"features": cmd_features, "fit": cmd_fit, "apply": cmd_apply}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
