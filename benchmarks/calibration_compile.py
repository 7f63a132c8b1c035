"""Compile, for an absent H200, the `qkvflow bench speed` step of an old commit, and save its optimised HLO.

    PYTHONPATH=<worktree of the old commit> python benchmarks/calibration_compile.py \
        --config_path benchmarks/configs/accelerator_small.yaml --batch 8 --model ode \
        --spec qkvflow/plan/specs/h200.txtpb --out_dir DIR

This script is deliberately self-contained: it imports only what `qkvflow bench speed` of the old commit
(on `PYTHONPATH`) imports (`qkvflow.bench.speed.load_config`, `baseline_config`, `with_attention`,
`qkvflow.training.loss.lm_loss`), never `qkvflow.plan`, which those commits do not have. It rebuilds the
step of `qkvflow.bench.speed.Step` of commits 942fec9 and d78930d, which ran the H200 rows of
`benchmarks/results/accelerator_h200_2026-11-26/` and `..._2026-11-27_dial/call2/` (loss and gradient of
`lm_loss` under the `p=f32,c=bfloat16` policy, Levanter's `AdamConfig(learning_rate=1e-4,
warmup=0.0).build(1_000_000)`, `jax.jit(step, donate_argnums=(0, 1))`, no depth-dial key), with the
attention kernel `auto` chose on the H200 (cuDNN), from abstract arrays on one compile-only device of the
XLA `GpuTargetConfigProto` in `--spec` (`jax.experimental.topologies`, as `qkvflow.plan.backend` does).

It writes `<tag>.hlo.txt` (the optimised HLO) and `<tag>.json` (the commit's config, batch, XLA's memory
accounting, compile seconds, jax version), where tag is `<config stem>_b<batch>_<model>`. The XLA memory
is printed beside the one the H200 measured for the same step, which checks that the program is the one
that ran.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path


def start_deviceless(spec_path: str):
    """One compile-only CUDA device for the target in `spec_path` (the process's JAX runs on the CPU)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    import jax_plugins.xla_cuda12  # noqa: F401  (registers the cuda platform)
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=Path(spec_path).read_text(), topology="1x1x1"
    )
    return list(topology.devices)[0]


def abstract_step_inputs(config, Vocab, Batch, optimizer):
    """(static model, params, opt_state, example) as shapes, built as the old `Step.__init__` builds them."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--model", choices=("ode", "baseline"), required=True)
    p.add_argument("--spec", required=True, help="a GpuTargetConfigProto text file (qkvflow/plan/specs/h200.txtpb)")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--commit", required=True, help="the commit on PYTHONPATH, recorded in the JSON")
    p.add_argument("--measured_json", default=None, help="the H200 speed JSON of this step (its XLA memory)")
    args = p.parse_args(argv)

    device = start_deviceless(args.spec)
    import equinox as eqx
    import haliax as hax
    import jax
    import jmp
    from levanter.optim import AdamConfig

    import qkvflow
    from qkvflow.bench import speed
    from qkvflow.training.loss import lm_loss

    config, defaults = speed.load_config(args.config_path)
    models = {"ode": config} if args.model == "ode" else {"baseline": speed.baseline_config(config)}
    models, kernel = speed.with_attention(models, "cudnn", "bf16")  # what `auto` chose on the H200
    model_config = models[args.model]
    Vocab, Batch = hax.Axis("vocab", defaults["vocab_size"]), hax.Axis("batch", args.batch)
    policy = jmp.get_policy(speed.DTYPES["bf16"])
    optimizer = AdamConfig(learning_rate=1e-4, warmup=0.0).build(1_000_000)
    static, params, opt_state, example = abstract_step_inputs(model_config, Vocab, Batch, optimizer)

    def loss_fn(params, example, key):
        model = policy.cast_to_compute(eqx.combine(params, static))
        out = lm_loss(model, example, key=key)
        loss = out[0] if isinstance(out, tuple) else out
        return loss.scalar() if isinstance(loss, hax.NamedArray) else loss

    def step(params, opt_state, example, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(params, example, key)
        with jax.named_scope("optimizer_update"):
            updates, opt_state = optimizer.update(grads, opt_state, params=params)
            return eqx.apply_updates(params, updates), opt_state, loss

    sharding = jax.sharding.SingleDeviceSharding(device)
    params, opt_state, example = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), (params, opt_state, example)
    )
    began = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, example, None).compile()
    seconds = time.perf_counter() - began
    m = compiled.memory_analysis()
    memory = {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
    }
    memory["total_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]
    )
    tag = f"{Path(args.config_path).stem}_b{args.batch}_{args.model}"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.hlo.txt").write_text(compiled.as_text())
    record = {
        "commit": args.commit,
        "qkvflow": qkvflow.__file__,
        "config_path": args.config_path,
        "model": args.model,
        "model_type": type(model_config).__name__,
        "batch": args.batch,
        "dtype": speed.DTYPES["bf16"],
        "attention": kernel,
        "target_spec": args.spec,
        "jax": jax.__version__,
        "compile_s": round(seconds, 1),
        "xla_memory": memory,
        "ode": dataclasses.asdict(model_config.ode) if hasattr(model_config, "ode") else None,
    }
    if args.measured_json:
        record["measured_xla_memory"] = measured_memory(args.measured_json, args.batch, args.model)
    (out / f"{tag}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(
        tag, "compiled in", round(seconds, 1), "s; XLA total", memory["total_bytes"], record.get("measured_xla_memory")
    )
    return 0


def measured_memory(path: str, batch: int, model: str):
    """The XLA memory the H200 run recorded for this batch and model (None if the file has no such row)."""
    data = json.loads(Path(path).read_text())
    for run in data.get("runs", [data]):
        if run["config"]["batch"] == batch:
            return run[model].get("xla_memory")
    return None


if __name__ == "__main__":
    raise SystemExit(main())
