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
import time
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import yaml

from qkvflow.bench.performance.memory import device_peak_bytes, process_peak, xla_memory
from qkvflow.bench.performance.peak import matmul_peak
from qkvflow.errors import UserError
from qkvflow.nn import attention
from qkvflow.runs import outputs

CORPUS_VOCAB = {"tinyshakespeare": 66, "pydoc": 2048}
DTYPES = {"f32": "p=f32,c=f32", "bf16": "p=f32,c=bfloat16"}


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
    p.add_argument("--json_out", default=None, help="also write the result to this JSON file (qkvflow.runs.outputs)")
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


def load_config(path: str) -> tuple:
    """(DiffEqFormer config, defaults from the file: batch, vocab_size)."""
    from qkvflow.models import registry
    from qkvflow.runs.compat import check_config

    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such config file")
    check_config(path)  # Levanter 1.2 keys (model.seq_len, ...): one line naming the replacement
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise UserError(f"{path}: needs a `model:` section (a diffeqformer_* or shared_ode_* model)")
    model = registry.decode(raw["model"])
    if not registry.is_ode(model):
        raise UserError(
            f"{path}: model.type must be an ODE model (diffeqformer_*/shared_ode_*), got {raw['model'].get('type')!r}"
        )
    bench = raw.get("bench") or {}
    corpus = raw.get("corpus") or {}
    batch = bench.get("batch") or (raw.get("trainer") or {}).get("train_batch_size") or 8
    vocab = bench.get("vocab_size") or corpus.get("vocab_size") or CORPUS_VOCAB.get(corpus.get("name"), 50257)
    return model, {"batch": int(batch), "vocab_size": int(vocab)}


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


def with_attention(models: dict, choice: str, dtype: str) -> tuple[dict, str]:
    """Every model config with `attn_backend` set to the kernel `choice` resolves to for `dtype` (the same
    one for all): the models and the kernel's name."""
    heads = {c.hidden_dim // c.num_heads for c in models.values()}
    kernel = attention.resolve(
        choice, jnp.bfloat16 if dtype == "bf16" else jnp.float32, head_size=heads.pop() if len(heads) == 1 else None
    )
    value = attention.config_value(kernel)
    return {name: dataclasses.replace(c, attn_backend=value) for name, c in models.items()}, kernel


def apply_overrides(model, args):
    ode = model.ode
    changes = {k: getattr(args, k) for k in ("num_steps", "solver", "adjoint", "checkpoints", "weight_cache", "loop")}
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        ode = dataclasses.replace(ode, **changes)
    top = {"ode": ode}
    if args.seq_len is not None:
        top["max_seq_len"] = args.seq_len
    if args.time_embed_dim is not None:
        top["time_embed_dim"] = args.time_embed_dim
    if getattr(args, "dial", None) is not None:
        top["dial"] = dial_config(args.dial)
    return dataclasses.replace(model, **top)


def dial_config(text: str):
    """`--dial`'s YAML mapping as a `DepthDialConfig`; one line naming the option otherwise."""
    from qkvflow.models.depth_dial import DepthDialConfig

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        raw = None
    names = [f.name for f in dataclasses.fields(DepthDialConfig)]
    if not isinstance(raw, dict) or set(raw) - set(names):
        raise UserError(f"--dial {text!r} is invalid: expected a YAML mapping with keys among {names}")
    if "train_steps" in raw:
        raw["train_steps"] = tuple(raw["train_steps"] or ())
    return DepthDialConfig(**raw)


def baseline_config(model, *, remat: bool = True):
    """Levanter's discrete model of the same shape, with one layer per vector-field evaluation
    (the flavour's `baseline`: Levanter's gpt2 or llama)."""
    from qkvflow.models.accounting import nominal_evaluations

    return BASELINES[model.flavour_spec.baseline](model, nominal_evaluations(model), remat)


def _gpt2_baseline(model, layers: int, remat: bool):
    from levanter.models.gpt2 import Gpt2Config

    if model.mlp_dim % model.hidden_dim:
        raise UserError(f"intermediate_dim={model.mlp_dim} must be a multiple of hidden_dim for the GPT-2 baseline")
    return Gpt2Config(
        max_seq_len=model.max_seq_len,
        hidden_dim=model.hidden_dim,
        num_layers=layers,
        num_heads=model.num_heads,
        mlp_scale=model.mlp_dim // model.hidden_dim,
        initializer_range=model.initializer_range,
        layer_norm_epsilon=model.layer_norm_epsilon,
        activation_function=model.activation_function,
        use_bias=model.bias,
        gradient_checkpointing=remat,
    )


def _llama_baseline(model, layers: int, remat: bool):
    from levanter.models.llama import LlamaConfig

    return LlamaConfig(
        max_seq_len=model.max_seq_len,
        hidden_dim=model.hidden_dim,
        intermediate_dim=model.mlp_dim,
        num_layers=layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_heads,
        activation_function=model.activation_function,
        initializer_range=model.initializer_range,
        layer_norm_epsilon=model.layer_norm_epsilon,
        tie_word_embeddings=model.tied_embeddings,
        rope=model.rope,
        gradient_checkpointing=remat,
    )


BASELINES = {"gpt2": _gpt2_baseline, "llama": _llama_baseline}
"""Levanter type name -> builder of that baseline (flavour.baseline names one)."""


def train_flops_per_token(config, vocab: int, tokens_per_batch: int) -> dict:
    """Model FLOPs of one training step per token: 3 x forward, plus the hypernetwork's share.
    Attention's FLOPs are at the full context (`max_seq_len`), as every benchmark step uses it."""
    from qkvflow.models import accounting, registry

    forward = float(config.flops_per_token(vocab, config.max_seq_len))
    hyper = 0.0
    if registry.is_ode(config):
        hyper = accounting.hypernetwork_flops_per_forward(config, vocab) / tokens_per_batch
    return {
        "forward_per_token": forward,
        "hypernetwork_forward_per_token": hyper,
        "train_per_token": 3.0 * (forward + hyper),
    }


def bench_optimizer(mu_dtype: str = "auto", **changes):
    """The benchmark's optimizer: Levanter's AdamConfig at a fixed learning rate (`changes` override its
    fields), with the hypernetwork projections' first moment in `mu_dtype` as `qkvflow train` stores it
    (`hypernetwork_mu_dtype`; `auto`, a new run's default: bfloat16)."""
    from levanter.optim import AdamConfig

    from qkvflow.training.step import with_hypernetwork_mu_dtype

    adam = AdamConfig(**({"learning_rate": 1e-4, "warmup": 0.0} | changes)).build(1_000_000)
    return with_hypernetwork_mu_dtype(adam, mu_dtype)


def train_step(static, policy, optimizer, vocab_block=None):
    """step(params, opt_state, example, key) -> (params, opt_state, loss): loss and gradient in the policy's
    compute dtype, then the optax update, as Levanter's trainer takes a step (`static`: the model's
    non-array part; `vocab_block`: the loss's, `loss_vocab_block`)."""
    from qkvflow.training.step import lm_loss

    def loss_fn(params, example, key):
        model = policy.cast_to_compute(eqx.combine(params, static))
        out = lm_loss(model, example, key=key, vocab_block=vocab_block)
        loss = out[0] if isinstance(out, tuple) else out
        return loss.scalar() if isinstance(loss, hax.NamedArray) else loss

    def step(params, opt_state, example, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(params, example, key)
        with jax.named_scope("optimizer_update"):  # benchmarks/profile_step.py finds it by this name
            updates, opt_state = optimizer.update(grads, opt_state, params=params)
            return eqx.apply_updates(params, updates), opt_state, loss

    return step


class Step:
    """A compiled training step of `config`, the way Levanter's trainer runs one."""

    def __init__(self, config, Vocab, Batch, dtype: str, *, seed: int = 0, vocab_block=None):
        from levanter.models.lm_model import LmExample

        key_model, key_tokens = jax.random.split(jax.random.PRNGKey(seed))
        model = config.build(Vocab, key=key_model)
        policy = jmp.get_policy(DTYPES[dtype])
        optimizer = bench_optimizer()
        params, static = eqx.partition(model, eqx.is_inexact_array)
        opt_state = optimizer.init(params)
        tokens = hax.random.randint(key_tokens, (Batch, config.max_Pos), 0, Vocab.size)
        example = hax.vmap(LmExample.causal, Batch)(tokens)

        # a DiffEqFormer with depth-dial recipes draws its grid from the training step's key (as in training)
        dial = getattr(config, "dial", None)
        self.key = jax.random.PRNGKey(seed + 1) if dial is not None and dial.active else None

        start = time.perf_counter()
        step = train_step(static, policy, optimizer, vocab_block)
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, example, self.key)
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - start
        self.state = (params, opt_state)
        self.example = example
        self.parameter_count = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
        self.times: list[float] = []
        self.loss = None
        self.peak_memory: dict | None = None

    def run(self) -> float:
        start = time.perf_counter()
        key = None if self.key is None else jax.random.fold_in(self.key, len(self.times))
        params, opt_state, loss = self.compiled(*self.state, self.example, key)
        loss.block_until_ready()
        elapsed = time.perf_counter() - start
        self.state, self.loss = (params, opt_state), float(loss)
        return elapsed


def nominal_peak_flops(dtype: str, override: float | None) -> dict:
    """One device's peak FLOP/s for MFU: `--peak-flops`, else Levanter's table (`fray.device_flops`, what
    its trainer's MFU uses) for the device kind and compute dtype; None on a CPU or an unknown device."""
    device = jax.devices()[0]
    if override is not None:
        return {"flops_per_s": override, "source": "--peak-flops"}
    if device.platform == "cpu":
        return {"flops_per_s": None, "source": "none for a CPU (set --peak-flops)"}
    from fray.device_flops import device_flops_for_jax_device

    # f32 matmuls run at JAX's default precision (lax.Precision.DEFAULT): TF32 on GPUs, one bfloat16
    # pass on TPUs; their peak is that rate's, not the data sheet's plain-fp32 one.
    kind = "bf16" if dtype == "bf16" else {"gpu": "tf32", "tpu": "bf16"}.get(device.platform, "fp32")
    flops = device_flops_for_jax_device(device.device_kind, kind)
    return {
        "flops_per_s": flops,
        "source": f"fray.device_flops[{device.device_kind!r}, {kind}]"
        if flops
        else f"unknown device {device.device_kind!r} for {kind} (set --peak-flops)",
    }


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
