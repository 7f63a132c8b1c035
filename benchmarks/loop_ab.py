"""The DiffEqFormer's training step with `ode.loop: diffrax` against `ode.loop: scan`, in one process.

    python benchmarks/loop_ab.py --config_path benchmarks/configs/speed.yaml [--repeats 10]

Both steps are `qkvflow.bench.performance.step.Step` (loss, gradient, Adam update), compiled and warmed up, then timed
alternately so that background load hits both alike. Prints the median step time of each, their ratio,
each step's final loss (the same model and data: equal to round-off) and XLA's temporary bytes.
"""

import argparse
import dataclasses

import haliax as hax
import numpy as np

from qkvflow.bench.performance.config import load_config
from qkvflow.bench.performance.memory import xla_memory
from qkvflow.bench.performance.step import Step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    args = p.parse_args()
    config, defaults = load_config(args.config_path)
    Vocab, Batch = hax.Axis("vocab", defaults["vocab_size"]), hax.Axis("batch", args.batch or defaults["batch"])
    steps = {}
    for loop in ("diffrax", "scan"):
        c = dataclasses.replace(config, ode=dataclasses.replace(config.ode, loop=loop))
        steps[loop] = Step(c, Vocab, Batch, args.dtype)
        for _ in range(2):
            steps[loop].run()
    times = {loop: [] for loop in steps}
    for _ in range(args.repeats):
        for loop, step in steps.items():
            times[loop].append(step.run())
    for loop, step in steps.items():
        t = np.asarray(times[loop])
        q1, q3 = np.percentile(t, [25, 75])
        temp = (xla_memory(step.compiled) or {}).get("temp_bytes")
        print(
            f"{loop:8s} median {np.median(t) * 1e3:7.1f} ms (IQR {q1 * 1e3:.1f}-{q3 * 1e3:.1f}), "
            f"loss {step.loss:.6f}, XLA temp {temp / 2**20 if temp else float('nan'):.1f} MiB"
        )
    print(f"scan / diffrax step time: {np.median(times['scan']) / np.median(times['diffrax']):.3f}")


if __name__ == "__main__":
    main()
