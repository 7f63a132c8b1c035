"""`qkvflow bench speed --config_path CFG`: training throughput of a DiffEqFormer against its baseline.

In one process: the DiffEqFormer of CFG's `model` section and Levanter's GPT-2 (or Llama) of the same
shape (hidden, heads, MLP, sequence, vocabulary; layers = the ODE's vector-field evaluations). Each
full training step (loss + gradient + optax update, jitted with donated state, as Levanter's trainer
does it) is compiled first, warmed up, then timed `--repeats` times, alternating the two models so
that background load hits both alike. Prints one JSON object on stdout and, on stderr, one line per
model: tokens/s, MFU and peak device memory ("n/a" where unknown).

FLOPs are model FLOPs (3 x forward, Levanter's convention; the ODE's includes its hypernetwork, none
include rematerialisation). Two MFUs: `mfu` is model FLOP/s over the device's nominal peak for the
compute dtype (Levanter's own table, `fray.device_flops`, as its trainer's throughput callback uses;
`--peak-flops` sets it, and there is none for a CPU), and `fraction_of_matmul_peak` is over a matmul
measured in the same run. The step runs on one device, so the peak is one device's.

`--batch` takes a list (`8,32,max`): each batch is built, warmed up and timed in turn (one JSON object
per batch, under `runs`, when there are several); `max` is the largest batch at which every model fits,
found from `--max_batch` down, halving on out-of-memory. Both models run the same attention kernel,
`--attention` (qkvflow.nn.attention; default `auto`, the fastest for the backend and compute dtype),
set on both configs.
"""

import argparse
import dataclasses
import gc
import json
import platform
import sys

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from qkvflow import outputs
from qkvflow.bench.performance.baseline import baseline_config
from qkvflow.bench.performance.config import apply_overrides, load_config, with_attention
from qkvflow.bench.performance.memory import device_peak_bytes, process_peak, xla_memory
from qkvflow.bench.performance.peak import matmul_peak, nominal_peak_flops
from qkvflow.bench.performance.step import DTYPES, Step
from qkvflow.errors import UserError
from qkvflow.models.accounting import train_flops_per_token
from qkvflow.nn import attention


def parser(prog="qkvflow bench speed") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", required=True, help="a train or bench config with a DiffEqFormer `model` section")
    p.add_argument(
        "--batch",
        default=None,
        help="a batch, or a comma-separated list of them; `max`: the largest that fits, from --max_batch down, "
        "halving on out-of-memory (default: bench.batch, trainer.train_batch_size, or 8)",
    )
    p.add_argument("--max_batch", type=int, default=256, help="where `--batch max` starts its search")
    p.add_argument(
        "--attention",
        choices=attention.CHOICES,
        default="auto",
        help="the attention kernel of both models (qkvflow.nn.attention; auto: the fastest for this backend "
        "and --dtype)",
    )
    p.add_argument("--seq_len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--vocab_size", type=int, default=None, help="default: bench.vocab_size, the corpus's, or 50257")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="compute dtype (parameters stay f32)")
    p.add_argument(
        "--loss_vocab_block",
        type=int,
        default=None,
        help="the cross-entropy's vocabulary block for both models (loss_vocab_block; at least the vocabulary: "
        "one product; default: each model's own)",
    )
    p.add_argument("--json_out", default=None, help="also write the result to this JSON file (qkvflow.outputs)")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--only", choices=("both", "ode", "baseline"), default="both")
    p.add_argument("--no_peak", action="store_true", help="skip the matmul-peak measurement")
    p.add_argument(
        "--peak-flops",
        "--peak_flops",
        dest="peak_flops",
        type=float,
        default=None,
        help="the device's peak FLOP/s for MFU (default: Levanter's table for the device kind and "
        "dtype; none on a CPU, where MFU is n/a)",
    )
    p.add_argument(
        "--baseline_remat",
        choices=("true", "false"),
        default="true",
        help="Levanter's gradient_checkpointing for the baseline (its default: true)",
    )
    # ODE overrides (used by `bench scaling`)
    p.add_argument("--num_steps", type=int, default=None)
    p.add_argument("--solver", default=None)
    p.add_argument("--adjoint", default=None)
    p.add_argument("--checkpoints", type=int, default=None)
    p.add_argument("--weight_cache", default=None)
    p.add_argument("--loop", default=None, help="the ODE's fixed-step loop: diffrax or scan (ode.loop)")
    p.add_argument("--time_embed_dim", type=int, default=None)
    p.add_argument(
        "--dial",
        default=None,
        help="the DiffEqFormer's depth-dial recipes as a YAML mapping, e.g. '{train_steps: [2, 4, 8], jitter: 0.5}' "
        "(qkvflow.models.depth_dial); each timed step draws its grid with a key of its own",
    )
    return p


def parse_batches(text) -> list:
    """`--batch`: one batch or a comma-separated list, each an integer >= 1 or `max`; ascending, `max` last
    (so that the allocator's peak read after each batch is that batch's)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part == "max":
            out.append(part)
            continue
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise UserError(f"--batch={part} is invalid: expected an integer >= 1 or max")
        out.append(value)
    return sorted(set(out), key=lambda b: (b == "max", 0 if b == "max" else b))


def is_out_of_memory(e: BaseException) -> bool:
    """XLA's out-of-memory errors (at compile or at run time) on GPU and TPU."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def summarise(step: Step, tokens: int, flops: dict, peak: dict | None, nominal: dict) -> dict:
    t = np.asarray(step.times)
    median = float(np.median(t))
    q1, q3 = (float(x) for x in np.percentile(t, [25, 75]))
    out = {
        "parameter_count": step.parameter_count,
        "compile_s": step.compile_s,
        "step_time_s": {"median": median, "iqr": [q1, q3], "min": float(t.min()), "max": float(t.max()), "n": len(t)},
        "tokens_per_s": tokens / median,
        "tokens_per_s_iqr": [tokens / q3, tokens / q1],
        "flops": flops,
        "achieved_flops_per_s": flops["train_per_token"] * tokens / median,
        "final_loss": step.loss,
        "xla_memory": xla_memory(step.compiled),
        "peak_device_memory": step.peak_memory,
    }
    out["fraction_of_matmul_peak"] = out["achieved_flops_per_s"] / peak["flops_per_s"] if peak else None
    out["mfu"] = out["achieved_flops_per_s"] / nominal["flops_per_s"] if nominal["flops_per_s"] else None
    return out


def report_line(name: str, r: dict) -> str:
    """One human-readable line: tokens/s, MFU, peak device memory ("n/a" where unknown)."""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    mem = r["peak_device_memory"]["bytes"]
    mem = "n/a" if mem is None else f"{mem / 2**20:,.1f} MiB"
    return f"{name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak device memory {mem}"


def build_steps(models: dict, Vocab, batch: int, args) -> dict:
    """Each model's compiled, warmed-up Step at `batch`, built one after the other, so that each model's
    device peak is read before the next exists: the first's is its own, a later one's includes the earlier
    models' resident state."""
    Batch = hax.Axis("batch", batch)
    steps = {}
    for i, (name, c) in enumerate(models.items()):
        step = steps[name] = Step(c, Vocab, Batch, args.dtype, vocab_block=args.loss_vocab_block)
        for _ in range(args.warmup):
            step.run()
        scope = "this model alone" if i == 0 else f"includes the resident state of {', '.join(list(models)[:i])}"
        step.peak_memory = {"bytes": device_peak_bytes(), "scope": scope, "after": "compile and warm-up"}
    return steps


def largest_batch(models: dict, Vocab, start: int, args) -> tuple[int, dict, list]:
    """The largest batch, from `start` down by halving, at which every model builds and runs: the batch,
    its steps and the batches that ran out of memory."""
    failed = []
    batch = start
    while batch >= 1:
        try:
            return batch, build_steps(models, Vocab, batch, args), failed
        except Exception as e:  # noqa: BLE001  (XLA raises its own runtime error types)
            if not is_out_of_memory(e):
                raise
            failed.append(batch)
            gc.collect()
            batch //= 2
    raise UserError(f"--batch max: no batch from {start} down to 1 fits in the device's memory")


def run(args, batch=None) -> dict:
    config, defaults = load_config(args.config_path)
    config = apply_overrides(config, args)
    if batch is None:
        batch = parse_batches(defaults["batch"] if args.batch is None else args.batch)[0]
    vocab = defaults["vocab_size"] if args.vocab_size is None else args.vocab_size
    sizes = [("vocab_size", vocab), ("repeats", args.repeats), ("max_batch", args.max_batch)]
    if args.loss_vocab_block is not None:
        sizes.append(("loss_vocab_block", args.loss_vocab_block))
    for name, value in sizes:
        if value < 1:
            raise UserError(f"--{name}={value} is invalid: expected an integer >= 1")
    if args.warmup < 0:
        raise UserError(f"--warmup={args.warmup} is invalid: expected an integer >= 0")
    if args.peak_flops is not None and not args.peak_flops > 0:
        raise UserError(f"--peak-flops={args.peak_flops} is invalid: expected FLOP/s > 0 (e.g. 989e12)")
    Vocab = hax.Axis("vocab", vocab)
    models = {}
    if args.only in ("both", "ode"):
        models["ode"] = config
    if args.only in ("both", "baseline"):
        models["baseline"] = baseline_config(config, remat=args.baseline_remat == "true")
    models, kernel = with_attention(models, args.attention, args.dtype)
    config = models.get("ode", config)

    search = None
    if batch == "max":
        batch, steps, failed = largest_batch(models, Vocab, args.max_batch, args)
        search = {"from": args.max_batch, "out_of_memory_at": failed}
        if failed:  # the allocator's peak now includes the attempts that did not fit
            for step in steps.values():
                step.peak_memory = {"bytes": None, "scope": "not measurable after an out-of-memory attempt"}
    else:
        steps = build_steps(models, Vocab, batch, args)
    tokens = batch * config.max_seq_len
    for _ in range(args.repeats):  # alternate, so that load changes hit both models alike
        for step in steps.values():
            step.times.append(step.run())
    peak = None if args.no_peak else matmul_peak(jnp.bfloat16 if args.dtype == "bf16" else jnp.float32)
    nominal = nominal_peak_flops(args.dtype, args.peak_flops)

    device = jax.devices()[0]
    result = {
        "device": {
            "platform": device.platform,
            "kind": device.device_kind,
            "count": jax.device_count(),
            "host": platform.node(),
            "jax": jax.__version__,
        },
        "config": {
            "path": args.config_path,
            "model_type": type(config).__name__,
            "batch": batch,
            "batch_search": search,
            "seq_len": config.max_seq_len,
            "tokens_per_step": tokens,
            "vocab_size": vocab,
            "hidden_dim": config.hidden_dim,
            "num_heads": config.num_heads,
            "mlp_dim": config.mlp_dim,
            "time_embed_dim": config.time_embed_dim,
            "ode": dataclasses.asdict(config.ode),
            "dial": dataclasses.asdict(config.dial) if hasattr(config, "dial") else None,
            "dtype": args.dtype,
            "attention": {"requested": args.attention, "kernel": kernel},
            "repeats": args.repeats,
            "warmup": args.warmup,
            "loss_vocab_block": args.loss_vocab_block,
        },
        "matmul_peak": peak,
        "nominal_peak": nominal,
    }
    for name, step in steps.items():
        flops = train_flops_per_token(models[name], vocab, tokens)
        result[name] = summarise(step, tokens, flops, peak, nominal)
        result[name]["attn_backend"] = str(models[name].attn_backend)
    if "baseline" in steps:
        result["baseline"]["model_type"] = type(models["baseline"]).__name__
        result["baseline"]["num_layers"] = models["baseline"].num_layers
        result["baseline"]["gradient_checkpointing"] = models["baseline"].gradient_checkpointing
    if len(steps) == 2:
        result["ratio_ode_over_baseline"] = result["ode"]["tokens_per_s"] / result["baseline"]["tokens_per_s"]
    result["process_peak_memory"] = process_peak()
    del steps
    gc.collect()  # the next batch's models start from a free device
    return result


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    batches = parse_batches(args.batch) if args.batch is not None else [None]
    if args.json_out:
        outputs.check_file(args.json_out, "--json_out", overwrite=args.overwrite)  # before any work
    runs = [run(args, batch) for batch in batches]
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    text = json.dumps(result)
    if args.json_out:
        outputs.write_file(args.json_out, "--json_out", json.dumps(result, indent=2) + "\n", overwrite=args.overwrite)
    print(text)
    for r in runs:
        for name in ("ode", "baseline"):
            if name in r:
                head = f"batch {r['config']['batch']} ({r['config']['tokens_per_step']:,} tokens), {name}"
                print(report_line(head, r[name]), file=sys.stderr)
    return 0
