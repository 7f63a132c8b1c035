"""`qkvflow plan` for the paper's configs: each DiffEqFormer and its baseline on 1 and 8 GPUs.

    python benchmarks/plan_paper.py [--target H100-80GB] [--devices 1,8] [--max_batch] [--only small,medium]
        [--out DIR] [--mu_dtype float32|bfloat16]

Each plan runs in a process of its own (a plan fixes the process's device count) and writes
`<config>__<target>x<devices>.json` into --out (default `benchmarks/results/plan_2026-11-28/`); a plan
already written is skipped, so the script resumes. --mu_dtype passes `--hypernetwork_mu_dtype` to each
plan and adds `__mu_<dtype>` to the file's name; with `bfloat16` only the DiffEqFormers are planned, as
their baselines have no hypernetwork projections (their plan is the `float32` one). The WikiText-103
configs have the same models as the OpenWebText ones (same shapes, tokenizer and batch), so their plans
are the OpenWebText ones. Needs the `gpu` extra.
Slow on a small CPU: a compile takes from about a minute (small) to many minutes (1B), and
--max_batch compiles 3-8 times per plan.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "plan_2026-11-28"
PAIRS = {
    "small": ("owt_small_ode", "owt_small_gpt2"),
    "medium": ("owt_medium_ode", "owt_medium_gpt2"),
    "large": ("owt_large_ode", "owt_large_gpt2"),
    "1b": ("owt_llama_1b_ode", "owt_llama_1b_llama"),
}
VOCAB = {"1b": 32000}  # the Llama-2 tokenizer's, which is not in a fresh cache (the others: GPT-2's, built in)


def stem(name: str, target: str, devices: int, mu_dtype=None) -> str:
    return f"{name}__{target}x{devices}" + (f"__mu_{mu_dtype}" if mu_dtype else "")


def run(name: str, size: str, target: str, devices: int, max_batch: bool, hlo_dir, out_dir: Path, mu_dtype) -> None:
    out = out_dir / f"{stem(name, target, devices, mu_dtype)}{'__max_batch' if max_batch else ''}.json"
    if out.exists():
        return
    cmd = [sys.executable, "-m", "qkvflow", "plan", "--config_path", str(ROOT / "configs/paper" / f"{name}.yaml")]
    cmd += ["--target", target, "--devices", str(devices), "--json"] + (["--max_batch"] if max_batch else [])
    if mu_dtype:
        cmd += ["--hypernetwork_mu_dtype", mu_dtype]
    if size in VOCAB:
        cmd += ["--vocab_size", str(VOCAB[size])]
    shown = " ".join(cmd[1:]).replace(str(ROOT) + "/", "")
    if hlo_dir:
        cmd += ["--save_hlo", str(Path(hlo_dir) / f"{out.stem}.hlo.txt")]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    took = time.time() - start
    if done.returncode != 0:
        print(f"{out.name}: failed ({took:.0f} s): {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    plan["command"] = shown
    plan["wall_s"] = round(took, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(plan, indent=1) + "\n")
    print(f"{out.name}: {took:.0f} s", flush=True)


def table(target: str, out: Path = OUT) -> str:
    """The markdown table of the plans written so far (benchmarks/results/plan_2026-11-28/README.md)."""
    rows = [
        "| pair | model | devices | per-device batch | memory per device (GiB) | fits | largest batch per device | "
        "collectives per step (GiB) | est. step (ms) | est. MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, names in PAIRS.items():
        for devices in (1, 2, 4, 8):
            for name in names:
                path = out / f"{name}__{target}x{devices}.json"
                if not path.exists():
                    continue
                p = json.loads(path.read_text())
                best = out / f"{name}__{target}x{devices}__max_batch.json"
                largest = "-"
                if best.exists():
                    found = json.loads(best.read_text())["max_batch"]
                    largest = f"{'' if found['exact'] else '≥ '}{found['per_device']}"
                comm = sum(c["bytes"] for c in p["collectives"].values()) / 2**30 if devices > 1 else 0
                e = p["estimate"]
                step = "n/a" if e["step_s"] is None else f"{e['step_s'] * 1e3:,.0f}"
                mfu = "n/a" if e["mfu"] is None else f"{e['mfu']:.0%}"
                rows.append(
                    f"| {size} | {p['model_type'].replace('Config', '')} | {devices} | {p['batch']['per_device']} | "
                    f"{p['memory']['total'] / 2**30:.1f} | {'yes' if p['fits'] else 'no'} | {largest} | {comm:.2f} | "
                    f"{step} | {mfu} |"
                )
    return "\n".join(rows)


def memory_table(before: Path, after: Path, target: str) -> str:
    """Memory per device of each GPT-2 pair: the plans in `before` (written without --mu_dtype) against
    those in `after` (--mu_dtype float32 and bfloat16), each DiffEqFormer with its ratio to the GPT-2 of
    its own folder; a GPT-2 that differs between the two folders shows both
    (benchmarks/results/plan_2026-11-28_stacked/README.md)."""
    rows = [
        "| pair | devices | GPT-2 (GiB) | DiffEqFormer, before (GiB, x GPT-2) | after stacking, f32 moments | "
        "after stacking, bf16 moments | est. step, x GPT-2 (before; after, bf16) |",
        "|---|---|---|---|---|---|---|",
    ]

    def load(path: Path):
        return json.loads(path.read_text()) if path.exists() else None

    def total(p):
        return p["memory"]["total"]

    def cell(p, base, key=total, gib=True) -> str:
        if p is None or base is None:
            return "-"
        return f"{key(p) / 2**30:.2f} ({key(p) / key(base):.2f})" if gib else f"{key(p) / key(base):.2f}"

    def step(q):
        return q["estimate"]["step_s"]

    for size in ("small", "medium", "large"):
        ode, gpt2 = PAIRS[size]
        for devices in (1, 8):
            old_ode, old_gpt2 = (load(before / f"{stem(n, target, devices)}.json") for n in (ode, gpt2))
            new_gpt2 = load(after / f"{stem(gpt2, target, devices, 'float32')}.json")
            f32, bf16 = (load(after / f"{stem(ode, target, devices, mu)}.json") for mu in ("float32", "bfloat16"))
            base = "-" if new_gpt2 is None else f"{total(new_gpt2) / 2**30:.2f}"
            if old_gpt2 is not None and (new_gpt2 is None or total(old_gpt2) != total(new_gpt2)):
                base += f" (before: {total(old_gpt2) / 2**30:.2f})"
            steps = f"{cell(old_ode, old_gpt2, step, False)}; {cell(bf16, new_gpt2, step, False)}"
            rows.append(
                f"| {size} | {devices} | {base} | {cell(old_ode, old_gpt2)} | {cell(f32, new_gpt2)} | "
                f"{cell(bf16, new_gpt2)} | {steps} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="H100-80GB")
    p.add_argument("--devices", default="1,8")
    p.add_argument("--max_batch", action="store_true")
    p.add_argument("--only", default=",".join(PAIRS))
    p.add_argument("--hlo_dir", default=None, help="also keep each compiled step's HLO text here")
    p.add_argument("--out", type=Path, default=OUT, help="the folder the JSON goes to (default: %(default)s)")
    p.add_argument(
        "--mu_dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="pass --hypernetwork_mu_dtype to each plan (default: not passed, the config's own value)",
    )
    p.add_argument("--table", action="store_true", help="print the markdown table of the plans in --out, and stop")
    p.add_argument(
        "--memory_table",
        type=Path,
        metavar="BEFORE",
        help="print the memory of the GPT-2 pairs in BEFORE (no --mu_dtype) against --out (both dtypes), and stop",
    )
    args = p.parse_args()
    if args.table:
        print(table(args.target, args.out))
        return
    if args.memory_table:
        print(memory_table(args.memory_table, args.out, args.target))
        return
    for size in args.only.split(","):
        for devices in (int(d) for d in args.devices.split(",")):
            for name in PAIRS[size]:
                if args.mu_dtype == "bfloat16" and name != PAIRS[size][0]:
                    continue  # a baseline has no hypernetwork projections: its plan is the float32 one
                run(name, size, args.target, devices, args.max_batch, args.hlo_dir, args.out, args.mu_dtype)


if __name__ == "__main__":
    main()
