"""`qkvflow bench scaling --what steps|d_emb|seq|batch`: step time and memory along one axis.

Every point runs `qkvflow bench speed --only ode|baseline` in a fresh subprocess, so the process
resident-set peak (`ru_maxrss`, or the allocator peak on GPU) belongs to that point alone. XLA's
own account of the compiled step (`xla_temp_bytes`: what the step allocates beyond parameters,
optimizer state and batch) is recorded too: on CPU it is the cleaner memory figure, since the
resident set includes the JAX runtime (several hundred MB).

Variants (ODE settings per point):
  rc_fixed_otf    RecursiveCheckpointAdjoint(checkpoints=K), weights generated on the fly
  rc_fixed_pre    RecursiveCheckpointAdjoint(checkpoints=K), weights precomputed for all times
  direct_otf      DirectAdjoint, weights on the fly
  ode             the config's own ODE settings
  baseline        Levanter's GPT-2/Llama of the same shape (layers = evaluations)
Writes OUT_DIR/scaling_<what>.csv and .png.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from qkvflow import outputs
from qkvflow.bench import OUT_DIR
from qkvflow.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
SWEEPS = {
    "steps": ("num_steps", [6, 12, 24, 48], ["rc_fixed_otf", "rc_fixed_pre", "direct_otf"]),
    "d_emb": ("time_embed_dim", [20, 64, 144], ["ode"]),
    "seq": ("seq_len", [32, 64, 128, 256], ["ode", "baseline"]),
    "batch": ("batch", [4, 8, 16, 32], ["ode", "baseline"]),
}
VARIANTS = {
    "rc_fixed_otf": ["--adjoint", "recursive_checkpoint", "--weight_cache", "on_the_fly"],
    "rc_fixed_pre": ["--adjoint", "recursive_checkpoint", "--weight_cache", "precompute"],
    "direct_otf": ["--adjoint", "direct", "--weight_cache", "on_the_fly"],
    "ode": [],
    "baseline": [],
}
COLUMNS = [
    "what",
    "value",
    "variant",
    "step_time_median_s",
    "step_time_q1_s",
    "step_time_q3_s",
    "tokens_per_s",
    "compile_s",
    "xla_temp_bytes",
    "xla_total_bytes",
    "process_peak_bytes",
    "process_peak_kind",
    "parameter_count",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qkvflow bench scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--what", required=True, help="one of " + ", ".join(SWEEPS))
    p.add_argument("--config_path", default=str(ROOT / "benchmarks" / "configs" / "scaling.yaml"))
    p.add_argument("--values", default=None, help="comma-separated points (default per sweep)")
    p.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--checkpoints", type=int, default=4, help="K for the rc_fixed_* variants")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--out_dir", default=OUT_DIR, help=f"folder of the output files (default {OUT_DIR})")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    p.add_argument("--no_plot", action="store_true")
    return p


def point(args, knob: str, value: int, variant: str, workdir: Path) -> dict:
    out = workdir / f"{knob}_{value}_{variant}.json"
    cmd = [
        sys.executable,
        "-m",
        "qkvflow",
        "bench",
        "speed",
        "--config_path",
        args.config_path,
        "--no_peak",
        "--only",
        "baseline" if variant == "baseline" else "ode",
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--dtype",
        args.dtype,
        "--json_out",
        str(out),
        f"--{knob}",
        str(value),
    ]
    cmd += VARIANTS[variant]
    if variant.startswith("rc_fixed"):
        cmd += ["--checkpoints", str(args.checkpoints)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"bench scaling: point {knob}={value} {variant} failed (exit {proc.returncode}): {last}")
    result = json.loads(out.read_text())
    r = result["baseline" if variant == "baseline" else "ode"]
    xla = r["xla_memory"] or {}
    peak = result["process_peak_memory"]
    return {
        "value": value,
        "variant": variant,
        "step_time_median_s": r["step_time_s"]["median"],
        "step_time_q1_s": r["step_time_s"]["iqr"][0],
        "step_time_q3_s": r["step_time_s"]["iqr"][1],
        "tokens_per_s": r["tokens_per_s"],
        "compile_s": r["compile_s"],
        "xla_temp_bytes": xla.get("temp_bytes"),
        "xla_total_bytes": xla.get("total_bytes"),
        "process_peak_bytes": peak["bytes"],
        "process_peak_kind": peak["kind"],
        "parameter_count": r["parameter_count"],
    }


def plot(rows: list[dict], what: str, knob: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [r for r in rows if r["variant"] == variant]
        x = [r["value"] for r in pts]
        axes[0].plot(x, [r["step_time_median_s"] * 1e3 for r in pts], "o-", label=variant)
        axes[1].plot(x, [(r["xla_temp_bytes"] or 0) / 2**20 for r in pts], "o-", label=variant)
        axes[2].plot(x, [r["process_peak_bytes"] / 2**20 for r in pts], "o-", label=variant)
    titles = ["step time (ms, median)", "XLA temporaries (MiB)", "process peak (MiB)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel(knob)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"qkvflow bench scaling --what {what}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.what not in SWEEPS:
        raise UserError(f"--what={args.what!r} is invalid: expected one of {', '.join(SWEEPS)}")
    if not Path(args.config_path).is_file():
        raise UserError(f"{args.config_path}: no such config file")
    knob, values, variants = SWEEPS[args.what]
    try:
        values = [int(v) for v in args.values.split(",")] if args.values else values
    except ValueError:
        raise UserError(f"--values={args.values!r} is invalid: expected comma-separated integers") from None
    if args.variants:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants:
            raise UserError(f"--variants={args.variants!r} is invalid: expected a subset of {','.join(VARIANTS)}")
    out_dir = Path(args.out_dir)
    csv_path, png_path = out_dir / f"scaling_{args.what}.csv", out_dir / f"scaling_{args.what}.png"
    for path in [csv_path] + ([] if args.no_plot else [png_path]):  # before any point
        outputs.check_file(path, "--out_dir", overwrite=args.overwrite)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qkvflow-scaling-") as tmp:
        for variant in variants:
            for value in values:
                row = {"what": args.what, **point(args, knob, value, variant, Path(tmp))}
                rows.append(row)
                print(json.dumps(row), flush=True)  # each row as it is measured; the CSV holds them all
    with outputs.writing_file(csv_path, "--out_dir", overwrite=args.overwrite) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_plot:
        with outputs.writing_file(png_path, "--out_dir", overwrite=args.overwrite) as tmp:
            plot(rows, args.what, knob, tmp)
    print(f"wrote {csv_path}" + ("" if args.no_plot else f" and {png_path}"))
    return 0
