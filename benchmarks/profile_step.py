"""Where one training step's time goes, kernel by kernel (XLA fused kernels via jax.profiler).

    python benchmarks/profile_step.py --config_path benchmarks/configs/speed.yaml [--model ode|baseline]
        [--loop diffrax|scan] [--checkpoints K] [--weight_cache precompute|on_the_fly] [--batch B]

Builds the same jitted step as `qkvflow bench speed` (`qkvflow.bench.performance.step.Step`), warms it up,
traces `--steps` steps and prints, per step:

* the kernel time by **part of the step**, each kernel placed by the JAX operation it came from (the
  compiled HLO's `op_name` metadata): the optimizer update and the hypernetwork's weight generation
  (named scopes set in `Step` and `generate_batched`), attention's core (Levanter's
  `dot_product_attention`: scores, softmax, weighted sum), the other matrix products (split into the
  feed-forward's, whose op_name names the `mlp` axis or module, and the rest: Q/K/V/O projections, unembedding),
  layout copies (copy/transpose kernels), and everything else (element-wise: norms, activations,
  the solver's updates and loop bookkeeping). Each part is split by pass: forward, recomputation
  (rematerialised forward inside the backward pass) and backward (`transpose(...)` in op_name);
* the time of each kind of kernel (`dot`, `multiply_add_fusion`, ...) and the slowest kernels with
  their output shape and operation.

Kernel times are summed over the threads that ran them, so on a multi-core CPU they exceed the wall time.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile

import haliax as hax
import jax

from qkvflow.bench.performance.baseline import baseline_config
from qkvflow.bench.performance.config import apply_overrides, load_config
from qkvflow.bench.performance.step import Step

HOST_EVENTS = ("Thunk", "$", "PjRt", "Execute", "PjitFunction", "shard_args", "SlinkyThreadPool", "ParseArguments")
# A loop's own event spans the kernels of its body, which are traced too: shown, not added.
CONTAINERS = ("while", "conditional", "call")
MATMUL_KINDS = ("dot", "ynn_fusion", "gemm", "cublas", "convolution", "xnn_fusion", "onednn")
COPY_KINDS = ("copy", "transpose")


def kernel_times(trace_dir: str) -> collections.Counter:
    (path,) = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    times = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(HOST_EVENTS) and "PjRt" not in e["name"]:
            times[e["name"]] += e.get("dur", 0) / 1e3  # ms
    return times


def hlo_metadata(hlo: str) -> dict[str, tuple[str, str]]:
    """instruction name -> (output shape, op_name) from the compiled HLO text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) [^\n]*?op_name=\"([^\"]*)\"", hlo, re.M):
        out[m.group(1)] = (m.group(2), m.group(3))
    return out


def classify(kernel: str, shape: str, op: str, mlp_dim: int) -> tuple[str, str]:
    """(part of the step, pass) of one kernel, from its name, output shape and JAX op_name."""
    kind = re.sub(r"[.\d]+$", "", kernel)
    phase = "forward"
    # The backward pass's own loop (diffrax's "checkpointed-bwd", Levanter's remat'd scan) recomputes
    # the forward there: a kernel in it is backward only if its own op is a transpose.
    loop = re.search(r"checkpointed-bwd/|rematted_computation/|remat\(|checkpoint\(", op)
    if loop:
        phase = "backward" if "transpose(" in op[loop.end() :] else "recompute"
    elif "transpose(" in op:
        phase = "backward"
    if "optimizer_update" in op:
        return "optimizer update", "-"
    if "weight_generation" in op:
        return "weight generation W(t_k)", phase
    if "dot_product_attention" in op:
        return "attention core (QK^T, softmax, AV)", phase
    if kind.startswith(MATMUL_KINDS):
        # haliax names a product by its axes ("contract embed -> batch, position, mlp"), Levanter's by
        # its module (Gpt2Mlp); failing both, a product whose shape carries the MLP width
        dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0])]
        if re.search(r"\bmlp\b|Mlp", op) or mlp_dim in dims:
            return "MLP products", phase
        return "other products (QKV/O, unembedding)", phase
    if any(k in kind for k in COPY_KINDS):
        return "layout copies", phase
    return "element-wise, loop and other", phase


def trace(step: Step, steps: int) -> tuple[float, collections.Counter]:
    """Mean wall time of `steps` traced steps, and each kernel's total time over them (ms)."""
    trace_dir = tempfile.mkdtemp(prefix="qkvflow-profile-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    wall = sum(step.run() for _ in range(steps)) / steps
    jax.profiler.stop_trace()
    return wall, kernel_times(trace_dir)


def report(wall: float, times: collections.Counter, hlo: str, steps: int, mlp_dim: int, top: int) -> None:
    meta = hlo_metadata(hlo)
    loops = {k: ms for k, ms in times.items() if re.sub(r"\.\d+$", "", k) in CONTAINERS}
    times = collections.Counter({k: ms for k, ms in times.items() if k not in loops})
    total = sum(times.values()) / steps
    print(f"step wall time {wall * 1e3:.0f} ms; kernel time summed over threads {total:.0f} ms")

    parts = collections.defaultdict(collections.Counter)
    for name, ms in times.items():
        shape, op = meta.get(name, ("?", "?"))
        part, phase = classify(name, shape, op, mlp_dim)
        parts[part][phase] += ms / steps
    print(f"{'part of the step':38s} {'total ms':>9s} {'share':>6s}  forward recompute backward")
    for part, by_phase in sorted(parts.items(), key=lambda kv: -sum(kv[1].values())):
        ms = sum(by_phase.values())
        split = "  ".join(f"{by_phase.get(p, 0.0):8.1f}" for p in ("forward", "recompute", "backward"))
        if "-" in by_phase:
            split = f"{'(one pass)':>28s}"
        print(f"{part:38s} {ms:9.1f} {100 * ms / total:5.1f}%  {split}")

    for name, ms in sorted(loops.items(), key=lambda kv: -kv[1]):
        print(
            f"loop event (spans its body's kernels, not added): {name} {ms / steps:.1f} ms  {meta.get(name, ('', '?'))[1]}"
        )
    kinds = collections.Counter()
    for name, ms in times.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    print("by kernel kind:")
    for kind, ms in kinds.most_common(top):
        print(f"{ms / steps:8.1f} ms  {kind}")
    print("slowest kernels:")
    for name, ms in times.most_common(top):
        shape, op = meta.get(name, ("?", "?"))
        print(f"{ms / steps:8.1f} ms  {name:30s} {shape[:24]:24s} {op[-90:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True)
    p.add_argument("--model", choices=("ode", "baseline"), default="ode")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--save", default=None, help="also write the kernel times and the HLO to this folder")
    p.add_argument("--load", default=None, help="report on a folder written by --save instead of running")
    for name in ("loop", "adjoint", "weight_cache", "solver"):
        p.add_argument(f"--{name}", default=None)
    for name in ("checkpoints", "num_steps", "seq_len", "time_embed_dim"):
        p.add_argument(f"--{name}", type=int, default=None)
    args = p.parse_args()
    if args.load:
        with open(os.path.join(args.load, "kernels.json")) as f:
            saved = json.load(f)
        with open(os.path.join(args.load, "step.hlo.txt")) as f:
            hlo = f.read()
        times = collections.Counter(saved["kernel_ms"])
        report(saved["wall_s"], times, hlo, saved["steps"], saved["mlp_dim"], args.top)
        return

    config, defaults = load_config(args.config_path)
    config = apply_overrides(config, args)
    if args.model == "baseline":
        config = baseline_config(config)
    batch = args.batch or defaults["batch"]
    step = Step(config, hax.Axis("vocab", defaults["vocab_size"]), hax.Axis("batch", batch), args.dtype)
    for _ in range(2):
        step.run()
    mlp_dim = config.hidden_dim * config.mlp_scale if args.model == "baseline" else config.mlp_dim
    wall, times = trace(step, args.steps)
    hlo = step.compiled.as_text()
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        with open(os.path.join(args.save, "kernels.json"), "w") as f:
            json.dump({"wall_s": wall, "steps": args.steps, "mlp_dim": mlp_dim, "kernel_ms": times}, f)
        with open(os.path.join(args.save, "step.hlo.txt"), "w") as f:
            f.write(hlo)
    report(wall, times, hlo, args.steps, mlp_dim, args.top)


if __name__ == "__main__":
    main()
