"""Kernel launches, fusions and memory of one training step compiled for a GPU that is not present.

    python benchmarks/kernel_count.py --config_path benchmarks/configs/accelerator_small.yaml \
        --target ../shared/gpu-targets/h200.txtpb --batch 8 --model ode [--json_out out.json]

Run it with the `gpu` extra installed (jax-cuda12-plugin); no GPU or driver is needed. The step is
`qkvflow.bench.speed`'s (loss, gradient, Levanter's Adam, donated state) for the config's DiffEqFormer
(`--model ode`) or its same-shape Levanter baseline (`--model baseline`), at `p=f32,c=bfloat16` (the
`--dtype` of `qkvflow bench speed`), with the attention kernel `auto` picks on a GPU. It is lowered from
abstract arrays (nothing is allocated) on a one-device topology described by the XLA
`GpuTargetConfigProto` text `--target`, and compiled (`jax.experimental.topologies`).

Counts come from the optimised HLO. A kernel launch is every instruction of a computation the GPU runs
as a sequence (the entry, loop bodies and conditions, branches, called computations) other than the ones
that launch nothing (parameters, constants, tuples, bitcasts, control flow itself). A while loop's body
counts once per iteration of its `known_trip_count` (its condition once more); the ODE solve's loops,
whose trip count XLA cannot know, count the config's `ode.num_steps` (fixed-step solvers); a conditional counts
its most expensive branch. Fused computations are inside their fusion's one launch. XLA may still merge
launches at run time (CUDA graphs / command buffers), so this is the number of kernels the program
asks for, not a measured count. Memory is `compiled.memory_analysis()`.
"""

import argparse
import dataclasses
import json
import re
import sys
from collections import Counter
from pathlib import Path

FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "domain",
}
"""Opcodes that launch no kernel themselves (control flow is counted through what it runs)."""

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_CALLED = {
    "while": re.compile(r"(condition|body)=%?([\w.\-]+)"),
    "call": re.compile(r"to_apply=%?([\w.\-]+)"),
    "conditional": re.compile(r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"),
}
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def parse(hlo: str) -> tuple[dict, str]:
    """{computation name: [(opcode, rest of line)]} and the entry computation's name."""
    computations, entry, current = {}, None, None
    for line in hlo.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            computations[current].append((m.group(1), m.group(2)))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def launches(computations: dict, name: str, memo: dict, unknown_trips: int = 1) -> dict:
    """{'kernels': launches of one run of `name`, 'by_opcode': Counter} (loops weighted by trip count)."""
    if name in memo:
        return memo[name]
    kernels, by_opcode = 0, Counter()

    def add(sub: dict, times: int = 1):
        nonlocal kernels
        kernels += times * sub["kernels"]
        for k, v in sub["by_opcode"].items():
            by_opcode[k] += times * v

    for opcode, rest in computations[name]:
        if opcode == "while":
            called = dict(_CALLED["while"].findall(rest))
            trip = _TRIP.search(rest)
            n = int(trip.group(1)) if trip else unknown_trips
            add(launches(computations, called["body"], memo, unknown_trips), n)
            add(launches(computations, called["condition"], memo, unknown_trips), n + 1)
        elif opcode == "call":
            for callee in _CALLED["call"].findall(rest):
                add(launches(computations, callee, memo, unknown_trips))
        elif opcode == "conditional":
            branches = []
            for group, single in _CALLED["conditional"].findall(rest):
                branches += [b.strip().lstrip("%") for b in group.split(",")] if group else [single]
            costs = [launches(computations, b, memo, unknown_trips) for b in branches if b]
            if costs:
                add(max(costs, key=lambda c: c["kernels"]))
        elif opcode not in FREE:
            kernels += 1
            by_opcode[opcode] += 1
    memo[name] = {"kernels": kernels, "by_opcode": by_opcode}
    return memo[name]


def count(hlo: str, unknown_trips: int = 1) -> dict:
    """Kernel launches per step (loops weighted), launches outside loops, per loop body, and fusions.
    A loop whose trip count XLA does not know (a diffrax solve's) counts `unknown_trips` iterations."""
    computations, entry = parse(hlo)
    memo: dict = {}
    total = launches(computations, entry, memo, unknown_trips)
    outside = sum(1 for op, _ in computations[entry] if op not in FREE)
    loops = []
    for op, rest in computations[entry]:
        if op == "while":
            called = dict(_CALLED["while"].findall(rest))
            trip = _TRIP.search(rest)
            body = launches(computations, called["body"], memo)["kernels"]
            loops.append({"trip_count": int(trip.group(1)) if trip else None, "kernels_per_iteration": body})
    reached = set(memo)
    fusions = sum(1 for c in reached for op, _ in computations[c] if op == "fusion")
    return {
        "kernel_launches": total["kernels"],
        "launches_outside_loops": outside,
        "loops": loops,
        "fusions": fusions,
        "by_opcode": dict(total["by_opcode"].most_common()),
    }


def abstract_inputs(config, Vocab, Batch, dtype: str, optimizer):
    """(static, params, opt_state, example) of `qkvflow.bench.speed.Step` as shapes: nothing allocated."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from levanter.models.lm_model import LmExample

    holder = {}

    def build():
        model = config.build(Vocab, key=jax.random.PRNGKey(0))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        holder["static"] = static
        tokens = hax.zeros((Batch, config.max_Pos), dtype=jnp.int32)
        return params, optimizer.init(params), hax.vmap(LmExample.causal, Batch)(tokens)

    params, opt_state, example = eqx.filter_eval_shape(build)
    return holder["static"], params, opt_state, example


def compile_step(config, Vocab, Batch, dtype: str, target_text: str, optimizer=None):
    """The compiled step for the target, and the seconds the compile took."""
    import time

    import jax
    import jmp
    from jax.experimental import topologies

    from qkvflow.bench.speed import DTYPES, bench_optimizer, train_step

    optimizer = optimizer or bench_optimizer()
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_text, topology="1x1x1")
    except Exception as e:  # noqa: BLE001  (no plugin, or a target text XLA cannot read)
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise SystemExit(f"kernel_count: cannot describe a CUDA target ({first}); install the gpu extra") from None
    mesh = topologies.make_mesh(topology, (1,), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    static, *inputs = abstract_inputs(config, Vocab, Batch, dtype, optimizer)
    inputs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), inputs)
    step = train_step(static, jmp.get_policy(DTYPES[dtype]), optimizer)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*inputs, None).compile()
    return compiled, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True)
    p.add_argument("--target", required=True, help="an XLA GpuTargetConfigProto text (e.g. h200.txtpb)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--model", choices=("ode", "baseline"), default="ode")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="bf16")
    p.add_argument("--bf16_moments", action="store_true", help="Adam's mu of the hypernetwork projections in bfloat16")
    p.add_argument("--json_out", default=None)
    p.add_argument("--hlo_out", default=None, help="also write the optimised HLO text here")
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")  # before any backend starts: the cuda plugin then compiles deviceless
    import haliax as hax
    import jax.numpy as jnp

    from qkvflow.bench.memory import xla_memory
    from qkvflow.bench.speed import baseline_config, load_config
    from qkvflow.nn import attention

    config, defaults = load_config(args.config_path)
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    kernel = attention.resolve("auto", dtype, platform="gpu", head_size=config.hidden_dim // config.num_heads)
    model = config if args.model == "ode" else baseline_config(config)
    model = dataclasses.replace(model, attn_backend=attention.config_value(kernel))
    optimizer = None
    if args.bf16_moments:
        from qkvflow.bench.speed import bench_optimizer
        from qkvflow.training.moments import with_hypernetwork_mu_dtype

        optimizer = with_hypernetwork_mu_dtype(bench_optimizer(), "bfloat16")
    Vocab, Batch = hax.Axis("vocab", defaults["vocab_size"]), hax.Axis("batch", args.batch)
    compiled, seconds = compile_step(model, Vocab, Batch, args.dtype, Path(args.target).read_text(), optimizer)
    hlo = compiled.as_text()
    # a fixed-step ODE solve is a while loop of num_steps iterations (forward, and again backward)
    trips = config.ode.num_steps if args.model == "ode" and not config.ode.is_adaptive else 1
    if args.hlo_out:
        Path(args.hlo_out).write_text(hlo)
    result = {
        "config_path": args.config_path,
        "target": args.target,
        "model": type(model).__name__,
        "batch": args.batch,
        "dtype": DTYPE_POLICY[args.dtype],
        "attention": kernel,
        "bf16_moments": args.bf16_moments,
        "compile_s": round(seconds, 1),
        "memory": xla_memory(compiled),
        "cudnn_attention_calls": hlo.count("__cudnn$fmha"),
        "unknown_trip_count_taken_as": trips,
        **count(hlo, trips),
    }
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0


DTYPE_POLICY = {"f32": "p=f32,c=f32", "bf16": "p=f32,c=bfloat16"}

if __name__ == "__main__":
    sys.exit(main())
