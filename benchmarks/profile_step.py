"""Where one training step's time goes, kernel by kernel (XLA:CPU/GPU fused kernels via jax.profiler).

    python benchmarks/profile_step.py --config_path benchmarks/configs/speed.yaml [--model ode|baseline]

Builds the same jitted step as `qkvflow bench speed` (`qkvflow.bench.speed.Step`), warms it up,
traces `--steps` steps and prints, per step, the time of each kind of kernel (the name without its
numeric suffix: `dot`, `multiply_add_fusion`, ...) and the slowest kernels with their output shape
and the JAX operation they came from (from the compiled HLO's metadata).
"""

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import haliax as hax
import jax

from qkvflow.bench.speed import Step, baseline_config, load_config

HOST_EVENTS = ("Thunk", "$", "PjRt", "Execute", "PjitFunction", "shard_args")


def kernel_times(trace_dir: str) -> collections.Counter:
    (path,) = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    times = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(HOST_EVENTS):
            times[e["name"]] += e.get("dur", 0) / 1e3  # ms
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True)
    p.add_argument("--model", choices=("ode", "baseline"), default="ode")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()

    config, defaults = load_config(args.config_path)
    if args.model == "baseline":
        config = baseline_config(config)
    step = Step(config, hax.Axis("vocab", defaults["vocab_size"]), hax.Axis("batch", defaults["batch"]), "f32")
    for _ in range(2):
        step.run()
    trace_dir = tempfile.mkdtemp(prefix="qkvflow-profile-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    wall = sum(step.run() for _ in range(args.steps)) / args.steps
    jax.profiler.stop_trace()

    times = kernel_times(trace_dir)
    kinds = collections.Counter()
    for name, ms in times.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    print(
        f"step wall time {wall * 1e3:.0f} ms; kernel time summed over threads {sum(times.values()) / args.steps:.0f} ms"
    )
    for kind, ms in kinds.most_common(args.top):
        print(f"{ms / args.steps:8.1f} ms  {kind}")
    hlo = step.compiled.as_text()
    print("slowest kernels:")
    for name, ms in times.most_common(args.top):
        m = re.search(r"  %" + re.escape(name) + r" = (\S+) .*?op_name=\"([^\"]*)\"", hlo)
        shape, op = (m.group(1), m.group(2)[-90:]) if m else ("?", "?")
        print(f"{ms / args.steps:8.1f} ms  {name:30s} {shape:24s} {op}")


if __name__ == "__main__":
    main()
