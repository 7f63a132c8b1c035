"""Where the roofline puts an H200 training step's time, by what each kernel computes (an estimate).

    # 1. compile both models' step for the H200 as tests/plan/test_plan_h200.py does, keep the HLO
    PYTHONPATH=$PWD python benchmarks/mfu_breakdown.py compile --out_dir DIR [--tag default]
    # 2. attribute each kernel's roofline time to a category; JSON and markdown
    PYTHONPATH=$PWD python benchmarks/mfu_breakdown.py analyse --out_dir DIR --tags default[,flags]

`compile` runs `qkvflow.plan.planner.plan` on benchmarks/configs/accelerator_small.yaml with
`--trainer.train_batch_size 32 --trainer.mp p=f32,c=bfloat16` for one `H200` (the `gpu` extra
installed; no GPU needed), once for the DiffEqFormer and once for the Levanter GPT-2 of the same shape
(`qkvflow.bench.performance.baseline.baseline_config`, the `--model baseline` of benchmarks/kernel_count.py and the
GPT-2 that `qkvflow bench speed` times). It writes DIR/TAG/{ode,gpt2}.hlo.txt (the optimised HLO;
`analyse` also reads it gzipped, as .hlo.txt.gz) and DIR/TAG/{ode,gpt2}.plan.json, and records
XLA_FLAGS: set it in the environment to compile with flags. `--loss_block N`: both models' loss at
vocabulary block N (`loss_vocab_block`; at least the vocabulary: one product).

`analyse` walks each HLO with `qkvflow.plan.roofline.kernels` (loops weighted by trip count, the
plan's rule; a product of two f32 operands at the f32 peak) and puts every kernel in the first
category that fits, by what it is and by its op metadata (`Instr.op_name`, the JAX name stack):

- attention: cuDNN's fused attention custom calls;
- optimizer: outside the loss's gradient (a name stack with neither `jvp(` nor `transpose(`: the
  non-finite guard, clipping, Adam), random-key splitting excepted;
- vocabulary: a kernel with an array one of whose dimensions is the vocabulary, padded or not (the
  embedding lookup and its gradient, the lm head's cast), every kernel inside a loop whose body has
  one (the loss's loops over vocabulary blocks, forward and backward), and a kernel with the op name
  of one of those (an iteration XLA peeled out of such a loop);
- hypernetwork (the DiffEqFormer only): the `weight_generation` scope, and the casts of the
  projections ([stack, d_emb, ...] arrays) to the compute dtype;
- layout: `copy` and `transpose` kernels, and fusions that only move data (copy, transpose,
  bitcast, reshape, broadcast, slice, concatenate, pad);
- matmul: the other kernels with matrix-product FLOPs (the blocks' GEMMs, forward, recomputed, backward);
- elementwise: the other fusions (norms, activations, residual adds, casts, reductions, stores of
  the saved activations);
- other: the rest.

Times are the plan's roofline (each kernel at peak FLOP/s or full bandwidth): an estimate, not a
measurement. MFU is the plan's: model FLOPs / (estimated step x peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks/configs/accelerator_small.yaml"
ARGS = ["--trainer.train_batch_size", "32", "--trainer.mp", "p=f32,c=bfloat16"]
MODELS = ("gpt2", "ode")
CATEGORIES = ("matmul", "attention", "vocabulary", "layout", "elementwise", "optimizer", "hypernetwork", "other")


def compile_both(out: Path, models=MODELS, loss_block: int | None = None) -> None:
    from qkvflow import cli
    from qkvflow.plan import backend, planner, targets
    from qkvflow.plan.config import PlanConfig, vocabulary

    backend.start(1)
    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        config = cli.parse(PlanConfig, ["--config_path", str(CONFIG), *ARGS], "plan")
        config = dataclasses.replace(config, loss_vocab_block=loss_block)  # both models alike
        if name == "gpt2":
            from qkvflow.bench.performance.baseline import baseline_config

            config = dataclasses.replace(config, model=baseline_config(config.model))
        start = time.perf_counter()
        plan = planner.plan(config, targets.get("H200"), 1, vocabulary(config), hlo_file=out / f"{name}.hlo.txt")
        plan["xla_flags"] = os.environ.get("XLA_FLAGS", "")
        plan["loss_block"] = loss_block
        plan["wall_s"] = round(time.perf_counter() - start, 1)
        (out / f"{name}.plan.json").write_text(json.dumps(plan, indent=1) + "\n")
        e = plan["estimate"]
        print(f"{name}: step {e['step_s'] * 1e3:.2f} ms, MFU {e['mfu']:.3f}, memory {plan['memory']['total']:,} B")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", choices=("compile", "analyse"))
    p.add_argument("--out_dir", required=True)
    p.add_argument("--tag", default="default", help="compile: the subfolder (e.g. default, flags)")
    p.add_argument("--tags", default="default", help="analyse: the subfolders to compare, comma-separated")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument(
        "--loss_block",
        type=int,
        default=None,
        help="compile: both models' loss at this vocabulary block (loss_vocab_block)",
    )
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    models = tuple(args.models.split(","))
    if args.verb == "compile":
        compile_both(out / args.tag, models, args.loss_block)
        return 0
    return analyse_main(out, args.tags.split(","), models)


MOVES = frozenset(
    "parameter constant tuple get-tuple-element bitcast copy transpose reshape broadcast slice concatenate pad".split()
)
"""Opcodes that only move or re-lay data: a fusion of these alone is a layout kernel."""


def reachable(module, names) -> set:
    """The computations `names` run, and the ones those call (fusions, loops, branches), transitively."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        for instr in module.computations[name]:
            for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
                        "false_computation"):  # fmt: skip
                todo.extend(instr.called(key))
    return seen


def vocabulary_dims(vocab: int):
    """A dimension of the vocabulary: its size, or the size padded up (to a block multiple) by under 25%."""
    return lambda d: vocab <= d <= 1.25 * vocab


def vocabulary_loops(module, is_vocab) -> set:
    """The computations inside a `while` whose body touches an array with a vocabulary dimension (the
    loss's loops over vocabulary blocks, forward and backward)."""
    inside = set()
    for body in module.computations.values():
        for instr in body:
            if instr.opcode != "while":
                continue
            comps = reachable(module, instr.called("body") + instr.called("condition"))
            if any(touches(module, i, is_vocab) for c in comps for i in module.computations[c]):
                inside |= comps
    return inside


def touches(module, instr, is_dim) -> bool:
    types = [instr.type, *module.operand_types(instr)]
    return any(is_dim(d) for t in types for _, dims in hlo_shapes(t) for d in dims)


def hlo_shapes(text):
    from qkvflow.plan import hlo

    return hlo.shapes(text)


def only_moves(module, instr) -> bool:
    """A `copy` or `transpose` kernel, or a fusion that only moves data (see MOVES)."""
    if instr.opcode in ("copy", "transpose"):
        return True
    if instr.opcode != "fusion":
        return False
    comps = reachable(module, instr.called("calls"))
    ops = {i.opcode for c in comps for i in module.computations[c]} - {"fusion"}
    return bool(ops) and ops <= MOVES


def category(module, instr, flops: float, *, is_vocab, vocab_loops, vocab_names, d_emb: int | None) -> str:
    """The category of one kernel (the order of the module docstring). `vocab_names`: the op names of the
    kernels inside the vocabulary loops (an iteration XLA peels out of a loop keeps its op name)."""
    name = instr.op_name()
    target = (instr.attr("custom_call_target") or "").strip('"')
    if instr.opcode == "custom-call" and "fmha" in target:
        return "attention"
    if name and "jvp(" not in name and "transpose(" not in name and "threefry" not in name:
        return "optimizer"
    if instr.comp in vocab_loops or touches(module, instr, is_vocab) or (name and name in vocab_names):
        return "vocabulary"
    if d_emb is not None and ("weight_generation" in name or is_hyper_cast(instr, d_emb)):
        return "hypernetwork"
    if only_moves(module, instr):
        return "layout"
    if flops > 0:
        return "matmul"
    if instr.opcode == "fusion":
        return "elementwise"
    return "other"


def is_hyper_cast(instr, d_emb: int) -> bool:
    """The cast of a hypernetwork projection to the compute dtype: [stack, d_emb, ...] arrays."""
    return any(len(dims) >= 3 and dims[1] == d_emb for _, dims in hlo_shapes(instr.type)) and "convert" in (
        instr.op_name() or ""
    )


def breakdown(text: str, plan: dict, *, hidden: int, d_emb: int | None = None) -> dict:
    """Per category: kernels (distinct), launches, FLOPs, bytes and roofline ms per step, and its share;
    `d_emb`: the DiffEqFormer's time embedding (None for GPT-2, which has no hypernetwork)."""
    from qkvflow.plan import hlo, roofline, targets

    target = targets.get(plan["target"])
    module = hlo.parse(text)
    trips = plan["estimate"]["unknown_trip_counts_taken_as"]
    is_vocab = vocabulary_dims(plan["vocab_size"])
    loops = vocabulary_loops(module, is_vocab)
    rows = defaultdict(lambda: {"kernels": 0, "launches": 0, "flops": 0.0, "bytes": 0.0, "ms": 0.0})
    peak, bw = target.peak_flops[plan["compute_dtype"]], target.hbm_bytes_per_s
    f32_peak = target.peak_flops["float32"]
    kernels = list(
        roofline.kernels(module, peak_flops=peak, hbm_bytes_per_s=bw, unknown_trip_count=trips, f32_peak_flops=f32_peak)
    )
    names = {k["instr"].op_name() for k in kernels if k["instr"].comp in loops} - {""}
    for k in kernels:
        cat = category(
            module, k["instr"], k["flops"], is_vocab=is_vocab, vocab_loops=loops, vocab_names=names, d_emb=d_emb
        )
        k["category"] = cat
        row, n = rows[cat], k["launches"]
        row["kernels"] += 1
        row["launches"] += n
        row["flops"] += n * k["flops"]
        row["bytes"] += n * k["bytes"]
        row["ms"] += n * (k["seconds"] or 0.0) * 1e3
    total = sum(r["ms"] for r in rows.values())
    out = {c: {**rows[c], "share": rows[c]["ms"] / total if total else 0.0} for c in CATEGORIES if c in rows}
    return {
        "categories": out,
        "kernels_ms": total,
        "loss": loss_facts(module, kernels, plan, hidden),
        "layout_kernels": layout_facts(module, kernels),
        "program": program_facts(plan),
        "estimates": {
            "f32_products_at_f32_peak": step_estimate(module, plan, target, trips, f32_peak),
            "all_products_at_compute_peak": step_estimate(module, plan, target, trips, None),
        },
    }


def step_estimate(module, plan, target, trips, f32_peak) -> dict:
    """The plan's step estimate from this HLO, with or without the f32 products charged at the f32 peak."""
    from qkvflow.plan import roofline

    e = roofline.estimate(
        module, peak_flops=target.peak_flops[plan["compute_dtype"]], hbm_bytes_per_s=target.hbm_bytes_per_s,
        link_bytes_per_s=target.link_bytes_per_s, model_flops=plan["estimate"]["model_flops"],
        unknown_trip_count=trips, f32_peak_flops=f32_peak,
    )  # fmt: skip
    return {"step_ms": e["step_s"] * 1e3, "mfu": e["mfu"], "f32_tflop": e["f32_flops"] / 1e12}


def loss_facts(module, kernels, plan, hidden: int) -> dict:
    """What the compiled program does over the vocabulary: the products' operand and result dtypes,
    the vocabulary sizes its arrays have (padded), the largest array of logits, FLOPs against the
    model's (forward + two backward products over the real vocabulary), bytes, f32 bytes."""
    from qkvflow.plan import hlo

    vocab, tokens = plan["vocab_size"], plan["batch"]["per_device"] * plan["batch"]["seq_len"]
    dots, sizes, largest = defaultdict(float), set(), (0, "")
    flops = nbytes = f32_bytes = 0.0
    for k in (k for k in kernels if k["category"] == "vocabulary"):
        instr, n = k["instr"], k["launches"]
        flops += n * k["flops"]
        nbytes += n * k["bytes"]
        types = [instr.type, *module.operand_types(instr)]
        f32_bytes += n * sum(hlo.nbytes(t) for t in types if t.lstrip("(").startswith("f32"))
        for t in types:
            for dtype, dims in hlo.shapes(t):
                sizes |= {d for d in dims if vocab <= d <= 1.25 * vocab}
                size = hlo.DTYPE_BYTES[dtype] * math.prod(dims)
                if tokens in dims and len(dims) == 2 and size > largest[0]:
                    largest = (size, f"{dtype}{list(dims)}")
        for kind, f in products(module, instr):
            dots[kind] += n * f
    model = 3 * 2.0 * tokens * vocab * hidden
    return {
        "vocab_size": vocab,
        "vocab_sizes_in_arrays": sorted(sizes),
        "products_flops": dict(sorted(dots.items())),
        "largest_token_by_vocab_array": largest[1],
        "flops": flops,
        "model_flops": model,
        "flops_over_model": flops / model,
        "bytes": nbytes,
        "f32_bytes": f32_bytes,
    }


def products(module, instr):
    """(operand dtypes -> result dtype, FLOPs) of each matrix product a kernel runs: the `dot`s of a
    fusion, or a cuBLAS GEMM custom call."""
    from qkvflow.plan import hlo, roofline

    def kind(i):
        ops = [hlo.shapes(t)[0][0] for t in module.operand_types(i)[:2]]
        return f"{' x '.join(ops)} -> {hlo.shapes(i.type)[0][0]}"

    target = instr.attr("custom_call_target") or ""
    if instr.opcode == "custom-call" and ("gemm" in target or "matmul" in target):
        f = roofline.kernel_flops(module, instr)
        if f:
            yield kind(instr), f
        return
    if instr.opcode == "fusion":
        for comp in reachable(module, instr.called("calls")):
            for i in module.computations[comp]:
                if i.opcode == "dot":
                    yield kind(i), roofline.kernel_flops(module, i)


def layout_facts(module, kernels) -> dict:
    """The copy and transpose kernels of the whole step, whatever their category."""
    rows = [k for k in kernels if only_moves(module, k["instr"])]
    return {
        "kernels": len(rows),
        "launches": sum(k["launches"] for k in rows),
        "bytes": sum(k["launches"] * k["bytes"] for k in rows),
        "ms": sum(k["launches"] * (k["seconds"] or 0.0) for k in rows) * 1e3,
    }


def program_facts(plan) -> dict:
    k, e = plan["kernels"], plan["estimate"]
    return {
        "launches": k["launches"],
        "static": k["static"],
        "fusions": k["fusions"],
        "custom_calls": k["custom_calls"],
        "memory_total": plan["memory"]["total"],
        "temporaries": plan["memory"]["temporaries"],
        "plan_step_ms": e["step_s"] * 1e3,
        "plan_mfu": e["mfu"],
        "hlo_flops": e["hlo_flops"],
        "hbm_bytes": e["hbm_bytes"],
        "xla_flags": plan.get("xla_flags", ""),
        "compile_s": plan.get("compile_s"),
    }


def read_hlo(path: Path) -> str:
    """The HLO text at `path`, or its gzipped copy `path.gz` (how the results folder keeps it)."""
    if path.exists():
        return path.read_text()
    return gzip.decompress(path.with_name(path.name + ".gz").read_bytes()).decode()


def analyse_main(out: Path, tags, models) -> int:
    import yaml

    shape = yaml.safe_load(CONFIG.read_text())["model"]
    result = {"config": str(CONFIG.relative_to(ROOT)), "args": ARGS, "target": "H200", "runs": {}}
    for tag in tags:
        for name in models:
            folder = out / tag
            plan = json.loads((folder / f"{name}.plan.json").read_text())
            d_emb = shape["time_embed_dim"] if name == "ode" else None
            text = read_hlo(folder / f"{name}.hlo.txt")
            result["runs"][f"{tag}/{name}"] = breakdown(text, plan, hidden=shape["hidden_dim"], d_emb=d_emb)
    (out / "breakdown.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "breakdown.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        "# Roofline breakdown of the H200 training step (computed, not measured)",
        "",
        f"`{result['config']}` {' '.join(result['args'])}, target {result['target']}, 1 device; "
        "each kernel at peak FLOP/s or full bandwidth (`qkvflow.plan.roofline`). Categories: "
        "benchmarks/mfu_breakdown.py's docstring.",
    ]
    for run, b in result["runs"].items():
        p, now, before = (
            b["program"],
            b["estimates"]["f32_products_at_f32_peak"],
            b["estimates"]["all_products_at_compute_peak"],
        )
        lines += [
            "",
            f"## {run}: step {now['step_ms']:.2f} ms, MFU {now['mfu']:.1%} (estimates; {before['step_ms']:.2f} ms, "
            f"{before['mfu']:.1%} with the {now['f32_tflop']:.2f} TFLOP of f32 products at the bf16 peak), "
            f"{p['launches']:,} launches, memory {p['memory_total'] / 1e9:.3f} GB",
            "",
            f"XLA_FLAGS: `{p['xla_flags'] or '(none)'}`",
            "",
            "| category | kernels | launches | TFLOP | GB moved | ms (estimate) | share |",
            "|---|---|---|---|---|---|---|",
        ]
        for c, r in b["categories"].items():
            lines.append(
                f"| {c} | {r['kernels']} | {r['launches']:,} | {r['flops'] / 1e12:.2f} | {r['bytes'] / 1e9:.2f} | "
                f"{r['ms']:.2f} | {r['share']:.1%} |"
            )
        loss, lay = b["loss"], b["layout_kernels"]
        lines += [
            "",
            "- vocabulary: products "
            + "; ".join(f"{k} {v / 1e12:.2f} TFLOP" for k, v in loss["products_flops"].items())
            + f"; vocabulary sizes in its arrays "
            f"{loss['vocab_sizes_in_arrays']}; largest tokens x vocabulary array {loss['largest_token_by_vocab_array']}; "
            f"{loss['flops'] / 1e12:.2f} TFLOP = {loss['flops_over_model']:.2f} x the model's "
            f"{loss['model_flops'] / 1e12:.2f}; {loss['bytes'] / 1e9:.1f} GB moved, {loss['f32_bytes'] / 1e9:.1f} GB of it f32",
            f"- copies and transposes (all categories): {lay['kernels']} kernels, {lay['launches']} launches, "
            f"{lay['bytes'] / 1e9:.2f} GB, {lay['ms']:.2f} ms",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
