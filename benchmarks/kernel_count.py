"""Kernel launches, fusions and memory of one training step compiled for a GPU that is not present.

    python benchmarks/kernel_count.py --config_path benchmarks/configs/accelerator_small.yaml \
        --target H200 --batch 8 --model ode [--json_out out.json]

Run it with the `gpu` extra installed (jax-cuda12-plugin); no GPU or driver is needed. The step is
`qkvflow.bench.performance.step`'s (loss, gradient, Levanter's Adam, donated state) for the config's DiffEqFormer
(`--model ode`) or its same-shape Levanter baseline (`--model baseline`), at `p=f32,c=bfloat16` (the
`--dtype` of `qkvflow bench speed`), with the attention kernel `auto` picks on a GPU. It is lowered from
abstract arrays (nothing is allocated) for one compile-only device of `--target` (a `qkvflow plan`
target name, H200, H100-80GB or A100-80GB, or an XLA `GpuTargetConfigProto` text file; the device
comes from `qkvflow.plan.backend`), and compiled.

Counts are `qkvflow.plan.hlo.count_kernels` of the optimised HLO, the counter `qkvflow plan` reports,
with the trip count `qkvflow plan` takes for the ODE solve's loops; `qkvflow/plan/hlo.py`'s module
docstring states the rule. Memory is `compiled.memory_analysis()`.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from qkvflow.errors import UserError
from qkvflow.plan.hlo import count_kernels


def abstract_inputs(config, Vocab, Batch, dtype: str, optimizer):
    """(static, params, opt_state, example) of `qkvflow.bench.performance.step.Step` as shapes: nothing allocated."""
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


def compile_step(config, Vocab, Batch, dtype: str, target, optimizer=None):
    """The step compiled for one compile-only device of `target`, and the seconds the compile took."""
    import time

    import jax
    import jmp
    import numpy as np

    from qkvflow.bench.performance.step import DTYPES, bench_optimizer, train_step
    from qkvflow.plan import backend

    optimizer = optimizer or bench_optimizer()
    mesh = jax.sharding.Mesh(np.array(backend.devices_for(target, 1)), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    static, *inputs = abstract_inputs(config, Vocab, Batch, dtype, optimizer)
    inputs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), inputs)
    step = train_step(static, jmp.get_policy(DTYPES[dtype]), optimizer)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*inputs, None).compile()
    return compiled, time.perf_counter() - start


def target_of(name: str):
    """A `qkvflow plan` GPU target by name, or one read from a GpuTargetConfigProto text file."""
    from qkvflow.plan import targets

    if Path(name).suffix == ".txtpb" or Path(name).is_file():
        return targets.from_spec_file(name)
    target = targets.get(name)
    if target.platform != "gpu":
        gpus = ", ".join(n for n, t in targets.TARGETS.items() if t.platform == "gpu")
        raise UserError(f"--target {name}: expected a GPU target ({gpus}) or a .txtpb file")
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True)
    p.add_argument("--target", required=True, help="a plan target name (H200) or a GpuTargetConfigProto text file")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--model", choices=("ode", "baseline"), default="ode")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="bf16")
    p.add_argument("--bf16_moments", action="store_true", help="Adam's mu of the hypernetwork projections in bfloat16")
    p.add_argument("--json_out", default=None)
    p.add_argument("--hlo_out", default=None, help="also write the optimised HLO text here")
    args = p.parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"kernel_count: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from qkvflow.plan import backend

    backend.start(1)  # before any backend starts: the cuda plugin then compiles deviceless
    import haliax as hax
    import jax.numpy as jnp

    from qkvflow.bench.performance.baseline import baseline_config
    from qkvflow.bench.performance.config import load_config
    from qkvflow.bench.performance.memory import xla_memory
    from qkvflow.nn import attention
    from qkvflow.plan.planner import unknown_trips

    target = target_of(args.target)
    config, defaults = load_config(args.config_path)
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    kernel = attention.resolve("auto", dtype, platform="gpu", head_size=config.hidden_dim // config.num_heads)
    model = config if args.model == "ode" else baseline_config(config)
    model = dataclasses.replace(model, attn_backend=attention.config_value(kernel))
    from qkvflow.bench.performance.step import bench_optimizer

    # float32 moments unless asked: the counts in benchmarks/results/2026-11-28_stacked_hypernetworks/ were made before
    # bfloat16 became the default
    optimizer = bench_optimizer("bfloat16" if args.bf16_moments else "float32")
    Vocab, Batch = hax.Axis("vocab", defaults["vocab_size"]), hax.Axis("batch", args.batch)
    compiled, seconds = compile_step(model, Vocab, Batch, args.dtype, target, optimizer)
    hlo = compiled.as_text()
    trips = unknown_trips(model)
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
        **count_kernels(hlo, unknown_trip_count=trips),
    }
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0


DTYPE_POLICY = {"f32": "p=f32,c=f32", "bf16": "p=f32,c=bfloat16"}

if __name__ == "__main__":
    sys.exit(main())
