"""How long `qkvflow ... --help` and the command line's early refusals take, for every verb.

    python benchmarks/cli_latency.py [--runs 5] [--json FILE]

Each case runs `python -m qkvflow ARGS` as a fresh process, `--runs` times, from the repository root,
and reports the median wall time and the median CPU time (user + sys of the child, from
`resource.getrusage(RUSAGE_CHILDREN)`), with its exit status. CPU time is what load does not inflate
much; wall time is what a user waits. The load average is printed before and after, with the date and
the commit. The target (issue 62, item 3): each case under 2 s of wall time on an idle 2-core machine.

The cases: `--help` of every command (qkvflow/cli/startup/table.json), `--version`, and at least one refusal per
verb that `qkvflow.cli.startup.early` makes before importing JAX, Levanter, transformers or draccus. The last
row, `describe` of the quickstart config, imports the whole stack and does the work: what every case
cost before the seam.
"""

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Q = "configs/quickstart.yaml"
MISSING = "no/such/path"

REFUSALS = [
    ["trian"],
    ["train", "--config_path", MISSING],
    ["train", "--config_path", Q, "--model.type", "diffeqformr"],
    ["describe", "--config_path", MISSING],
    ["finetune", "--config_path", MISSING],
    ["sweep", "--config_path", MISSING],
    ["eval", "--config_path", Q, "--checkpoint", MISSING],
    ["eval", "--config_path", Q, "--checkpoint", "configs", "--steps", "2,x"],
    ["generate", "--config_path", Q, "--checkpoint", MISSING, "--prompt", "hi"],
    ["generate", "--config_path", Q, "--checkpoint", "configs", "--prompts_file", MISSING],
    ["export", "--config_path", Q, "--checkpoint", MISSING, "--output", "out"],
    ["analyze", "spectra", "--config_path", Q, "--checkpoint", MISSING],
    ["analyze", "spectrum"],
    ["tokenizer", "--files", MISSING, "--output", "out"],
    ["plan", "--config_path", Q, "--target", "v4"],
    ["plan", "--config_path", Q, "--target", "H200", "--devices", "0"],
    ["plan", "--config_path", Q, "--target", "H200", "--devices", "8", "--trainer.mesh.axes", "{model: 3}"],
    ["bench", "sped"],
    ["bench", "speed", "--config_path", MISSING],
]
REFERENCE = ["describe", "--config_path", Q]
"""A command that imports the stack and works: what a refusal cost before `qkvflow.cli.startup.early`."""


def cases() -> list[list[str]]:
    helps = json.loads((ROOT / "qkvflow" / "cli" / "startup" / "table.json").read_text())["help"]
    return [[*command.split(), "--help"] for command in helps] + [["--version"], *REFUSALS]


def run_once(args: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit status) of one `python -m qkvflow ARGS`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "qkvflow", *args], cwd=ROOT, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def measure(args: list[str], runs: int) -> dict:
    samples = [run_once(args) for _ in range(runs)]
    return {
        "command": "qkvflow " + " ".join(args),
        "wall_s": statistics.median(s[0] for s in samples),
        "cpu_s": statistics.median(s[1] for s in samples),
        "status": sorted({s[2] for s in samples}),
    }


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs per case; the median is reported")
    p.add_argument("--reference_runs", type=int, default=1, help="runs of the reference command (slow)")
    p.add_argument("--json", default=None, help="also write the rows and the conditions to this file")
    args = p.parse_args()
    load_before = os.getloadavg()
    rows = [measure(c, args.runs) for c in cases()]
    reference = measure(REFERENCE, args.reference_runs)
    load_after = os.getloadavg()
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "runs": args.runs,
    }
    print(
        f"{header['date']}, commit {header['commit']}, {header['cpus']} CPUs, load average (1, 5, 15 min) "
        f"{header['load_before']} before, {header['load_after']} after; median of {args.runs} runs\n"
    )
    print("| command | wall s | CPU s | exit |\n|---|---|---|---|")
    for row in [*rows, reference]:
        status = ",".join(str(s) for s in row["status"])
        print(f"| `{row['command']}` | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {status} |")
    worst = max(rows, key=lambda r: r["wall_s"])
    print(
        f"\nslowest early answer: {worst['wall_s']:.2f} s wall (`{worst['command']}`); "
        f"max CPU {max(r['cpu_s'] for r in rows):.2f} s; the reference command: {reference['wall_s']:.2f} s wall, "
        f"{reference['cpu_s']:.2f} s CPU"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "rows": rows, "reference": reference}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
