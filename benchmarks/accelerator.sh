#!/usr/bin/env bash
# Everything qkvflow checks on an accelerator, in one command: install with the accelerator's jax,
# train the quickstart, run the gpu-marked tests, and time the DiffEqFormer against the GPT-2 of the
# same shape at two sizes and several batches up to the largest that fits (tokens/s, MFU, peak memory),
# and Levanter's own train_lm on GPT-2 small as a reference. Results go to --out; summary.md sums them up.
# --no-install uses the JAX already installed (NVIDIA's JAX containers, a machine without network);
# --cpu-dry-run runs the same steps at tiny sizes on the CPU with the current environment (no install).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

OUT=""
EXTRA=""
DRY_RUN=0
NO_INSTALL=0
BATCHES=8,32,max
MAX_BATCH=64
STEPS=""
CORPORA=""
# The interpreter: $PYTHON, else the project's venv (what the README's set-up makes), else python3.
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
SHAPES=(small medium)

usage() {
    cat <<USAGE
usage: $(basename "$0") [--out DIR] [--extra gpu|tpu] [--steps LIST] [--corpora DIR] [--no-install]
       [--batches LIST] [--max-batch N] [--cpu-dry-run]

Runs, from the repository root, each step below; a failing step is recorded and the others still run
(exit status 1 if any failed). Each step's output is in DIR/<step>.log, DIR/status.tsv lists them.
  install     \$PYTHON -m pip install -e '.[EXTRA,test]' (EXTRA: gpu when nvidia-smi lists a GPU,
              tpu on a TPU VM (/dev/accel0 or /dev/vfio), else --extra)
  quickstart  qkvflow train --config_path configs/quickstart.yaml, outputs under DIR
  tests       pytest -m gpu tests/test_gpu.py tests/nn/test_attention.py (1 vs 2 devices, ODE ==
              discretised, HF export == JAX, cuDNN attention == the equation)
  speed       qkvflow bench speed --dtype bf16 at benchmarks/configs/accelerator_{small,medium}.yaml,
              the DiffEqFormer and its same-shape GPT-2 each in its own process (so that the
              process's peak memory is that model's), at each batch of --batches (max: the largest
              that fits, halving from --max-batch on out-of-memory): DIR/speed_<shape>_<ode|baseline>.json
  reference   Levanter's own levanter.main.train_lm on GPT-2 small (context 1024, bf16 compute, batch 32,
              random tokens, no network; benchmarks/levanter_reference.py): DIR/levanter/summary.json
  summary     DIR/summary.md and DIR/summary.json: tokens/s, MFU, peak memory per shape, batch, model

options:
  --out DIR       results folder (default: accelerator-results-<UTC time>)
  --extra E       gpu or tpu: the pyproject extra to install (default: detected)
  --steps LIST    comma-separated subset of: install,quickstart,tests,speed,reference,summary (default: all;
                  with --no-install or --cpu-dry-run all but install)
  --corpora DIR   where the quickstart finds, or builds, its corpus (default: the config's
                  corpus.root; with --cpu-dry-run, DIR/corpora under --out)
  --no-install    no install step: run with the JAX (and qkvflow's dependencies) that \$PYTHON already
                  imports, e.g. an NVIDIA JAX container or a machine without network (checked first:
                  a \$PYTHON that cannot import jax stops the script in one line)
  --batches LIST  bench speed's batches (default 8,32,max; 32 x 1024 tokens is the batch that fills an
                  H100/H200 at the small shape)
  --max-batch N   where max starts (default 64)
  --cpu-dry-run   tiny sizes on the CPU (JAX_PLATFORMS=cpu), current environment, no install, nothing
                  written outside DIR (and --corpora); for checking this script
                  (tests/test_accelerator_script.py)
  -h, --help      this text
Interpreter: \$PYTHON (default: the project's .venv/bin/python if there is one, else python3); without
an install step it must import qkvflow's dependencies (checked first, in one line). MFU is model FLOPs
per second over the device's nominal peak: bench speed's own \`mfu\` where it reports one, else this
script's bf16 table (H100/H200/A100, TPU v4/v5e/v5p/v6e); the summary also gives the fraction of a
matmul measured in the same process. Peak memory: bench speed's per-model device peak, else the
process's peak (host RSS on a CPU).
USAGE
}

die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --out|--extra|--steps|--corpora|--batches|--max-batch)
            [ $# -ge 2 ] || die "$1 needs a value"
            case "$1" in
                --out) OUT=$2 ;;
                --extra) EXTRA=$2 ;;
                --steps) STEPS=$2 ;;
                --corpora) CORPORA=$2 ;;
                --batches) BATCHES=$2 ;;
                --max-batch) MAX_BATCH=$2 ;;
            esac
            shift 2 ;;
        --cpu-dry-run) DRY_RUN=1; shift ;;
        --no-install) NO_INSTALL=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done

if [ -z "$STEPS" ]; then
    if [ "$DRY_RUN" = 1 ] || [ "$NO_INSTALL" = 1 ]; then
        STEPS=quickstart,tests,speed,reference,summary
    else
        STEPS=install,quickstart,tests,speed,reference,summary
    fi
fi
IFS=, read -r -a STEP_LIST <<<"$STEPS"
for step in "${STEP_LIST[@]}"; do
    case "$step" in
        install|quickstart|tests|speed|reference|summary) ;;
        *) die "unknown step '$step' in --steps (expected install, quickstart, tests, speed, reference, summary)" ;;
    esac
done
wants() {
    local step
    for step in "${STEP_LIST[@]}"; do [ "$step" = "$1" ] && return 0; done
    return 1
}

if [ "$DRY_RUN" = 1 ]; then
    wants install && die "--cpu-dry-run does not install: drop install from --steps"
    EXTRA=cpu
elif [ -z "$EXTRA" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        EXTRA=gpu
    elif [ -e /dev/accel0 ] || [ -d /dev/vfio ]; then
        EXTRA=tpu
    else
        die "no accelerator found (no nvidia-smi GPU, no /dev/accel0): pass --extra gpu|tpu, or --cpu-dry-run"
    fi
fi
# The accelerator first (jax's default backend), and the CPU beside it: Levanter's data loader batches on
# a one-CPU mesh and Haliax converts state dicts to numpy through the CPU backend (export), so a run
# with the accelerator alone fails there ("Unknown backend cpu", seen on an H100).
case "$EXTRA" in
    gpu) export JAX_PLATFORMS=cuda,cpu ;;
    tpu) export JAX_PLATFORMS=tpu,cpu ;;
    cpu) export JAX_PLATFORMS=cpu ;;
    *) die "--extra must be gpu or tpu, got '$EXTRA'" ;;
esac
if [ "$NO_INSTALL" = 1 ]; then
    wants install && die "--no-install does not install: drop install from --steps"
    version=$("$PYTHON" -c 'import jax; print(jax.__version__)' 2>/dev/null) ||
        die "--no-install: $PYTHON cannot import jax; install it (or drop --no-install to install with pip)"
    echo "using the installed jax $version ($PYTHON)"
fi
# Without an install step, the interpreter must already import qkvflow and what it needs (checked from the
# repository root, where the steps run): else one line, not a traceback from each step.
if ! wants install; then
    missing=$(cd "$ROOT" && "$PYTHON" -c 'import jax, draccus, levanter, diffrax, qkvflow.cli' 2>&1 | tail -n 1) ||
        die "$PYTHON cannot import qkvflow's dependencies (${missing:-no output}): name the project's venv, e.g. PYTHON=.venv/bin/python bash benchmarks/accelerator.sh ..."
fi

# Levanter's fused cross-entropy sweeps 7 Pallas block sizes on a GPU when none is tuned for the shape.
# On an H200 it refused every one and fell back to its XLA loss (docs/performance.md, "What holds MFU"),
# after the sweep's compiles: train_lm's first step was still in them after 120 s. Unless set, no sweep on
# a miss, for both models and Levanter's reference alike; the log says which loss path each one ran.
export LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS=${LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS:-0}
echo "Levanter's Pallas cross-entropy autotuning on a miss: LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS=$LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS"
OUT=${OUT:-accelerator-results-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
if [ "$STEPS" != summary ]; then : >"$OUT/status.tsv"; else touch "$OUT/status.tsv"; fi  # summary alone: keep the run's
FAILED=0

# run STEP COMMAND...: COMMAND's output to OUT/STEP.log (and the terminal), its status to status.tsv.
run() {
    local step=$1 start status
    shift
    echo "== $step: $*" | tee -a "$OUT/$step.log"
    start=$(date +%s)
    set +e
    "$@" 2>&1 | tee -a "$OUT/$step.log"
    status=${PIPESTATUS[0]}
    set -e
    printf '%s\t%s\t%ss\n' "$step" "$status" "$(($(date +%s) - start))" >>"$OUT/status.tsv"
    if [ "$status" != 0 ]; then
        echo "== $step failed (exit $status): see $OUT/$step.log" >&2
        FAILED=1
    fi
    return 0
}

if wants install; then
    run install "$PYTHON" -m pip install -e "${ROOT}[${EXTRA},test]"
fi

if wants quickstart; then
    QUICK=(--trainer.id accelerator_quickstart
           --trainer.checkpointer.base_path "$OUT/checkpoints"
           --trainer.tracker "{type: jsonl, path: $OUT/runs}"
           --trainer.log_dir "$OUT/logs")
    if [ "$DRY_RUN" = 1 ]; then
        QUICK+=(--trainer.num_train_steps 2 --trainer.train_batch_size 2 --trainer.steps_per_eval 2
                --trainer.max_eval_batches 1 --trainer.per_device_eval_parallelism 2
                --model.max_seq_len 32 --model.hidden_dim 32 --model.num_heads 2 --model.time_embed_dim 8
                --model.ode.num_steps 2 --loss_curve null --trainer.log_jaxprs false --trainer.log_xla_hlo false)
        CORPORA=${CORPORA:-$OUT/corpora}
    fi
    if [ -n "$CORPORA" ]; then QUICK+=(--corpus.root "$CORPORA"); fi
    run quickstart "$PYTHON" -m qkvflow train --config_path configs/quickstart.yaml "${QUICK[@]}"
fi

if wants tests; then
    run tests "$PYTHON" -m pytest -m gpu tests/test_gpu.py tests/nn/test_attention.py --continue-on-collection-errors -p no:cacheprovider -rs --junitxml "$OUT/pytest_gpu.xml"
fi

if wants speed; then
    SPEED=(--dtype bf16 --batch "$BATCHES" --max_batch "$MAX_BATCH")
    if [ "$DRY_RUN" = 1 ]; then
        SHAPES=(dry_run)
        SPEED=(--dtype f32 --repeats 2 --warmup 1 --no_peak --batch max --max_batch 2)
    fi
    for shape in "${SHAPES[@]}"; do
        for only in ode baseline; do
            run speed "$PYTHON" -m qkvflow bench speed --config_path "benchmarks/configs/accelerator_$shape.yaml" \
                --only "$only" "${SPEED[@]}" --json_out "$OUT/speed_${shape}_${only}.json"
        done
    done
fi

if wants reference; then
    REFERENCE=(--out "$OUT/levanter" --batch 32 --steps 20)
    if [ "$DRY_RUN" = 1 ]; then REFERENCE=(--out "$OUT/levanter" --batch 2 --steps 3 --dry-run); fi
    run reference "$PYTHON" benchmarks/levanter_reference.py "${REFERENCE[@]}"
fi

if wants summary; then
    run summary "$PYTHON" - "$OUT" <<'PY'
"""Sum up OUT/speed_<shape>_<model>.json (one run, or several under `runs`, one per batch) and Levanter's
train_lm reference (OUT/levanter/summary.json): tokens/s, MFU, peak memory."""
import glob, json, os, sys

out = sys.argv[1]
# Nominal dense bf16 FLOP/s (vendor data sheets), by a substring of jax's device_kind.
NOMINAL = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12),
           ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v4", 275e12)]
rows = []
for path in sorted(glob.glob(os.path.join(out, "speed_*_*.json"))):
    shape, model = os.path.basename(path)[len("speed_"):-len(".json")].rsplit("_", 1)
    loaded = json.load(open(path))
    for r in loaded.get("runs", [loaded]):
        m = r[model]
        kind = r["device"]["kind"]
        peak = next((f for name, f in NOMINAL if name.lower() in kind.lower()), None)
        peak = peak if r["config"]["dtype"] == "bf16" else None  # the table holds bf16 peaks only
        mfu, mfu_source = m.get("mfu"), (r.get("nominal_peak") or {}).get("source")  # bench speed's own, if it has one
        if mfu is None and peak:
            mfu, mfu_source = m["achieved_flops_per_s"] / peak, f"{peak:.3g} FLOP/s (this script's table)"
        # bench speed's per-model device peak (after compile and warm-up), else the process's peak
        mem = m.get("peak_device_memory") or {}
        if mem.get("bytes") is None:
            mem = r.get("process_peak_memory") or {}
        rows.append({
            "shape": shape, "model": m.get("model_type", r["config"]["model_type"]) if model == "baseline" else r["config"]["model_type"],
            "role": model, "device": f"{r['device']['count']} x {kind}", "dtype": r["config"]["dtype"],
            "batch": r["config"]["batch"], "tokens_per_step": r["config"]["tokens_per_step"],
            "parameters": m["parameter_count"], "attention": r["config"].get("attention", {}).get("kernel"),
            "tokens_per_s": m["tokens_per_s"], "tokens_per_s_iqr": m["tokens_per_s_iqr"],
            "mfu_nominal": mfu, "mfu_peak_source": mfu_source,
            "fraction_of_matmul_peak": m.get("fraction_of_matmul_peak"),
            "peak_memory_bytes": mem.get("bytes"), "peak_memory_kind": mem.get("kind") or mem.get("scope"),
            "xla_total_bytes": (m.get("xla_memory") or {}).get("total_bytes"),
        })
reference = os.path.join(out, "levanter", "summary.json")
reference = json.load(open(reference)) if os.path.exists(reference) else None
json.dump({"speed": rows, "levanter_train_lm": reference}, open(os.path.join(out, "summary.json"), "w"), indent=1)
pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
gib = lambda x: "n/a" if x is None else f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"
lines = ["| shape | batch | model | device | attention | tokens/s (IQR) | MFU (nominal) | of measured matmul "
         "| peak memory | XLA step total |", "|---|---|---|---|---|---|---|---|---|---|"]
for w in rows:
    lo, hi = w["tokens_per_s_iqr"]
    lines.append(f"| {w['shape']} | {w['batch']} | {w['model']} ({w['role']}) | {w['device']} | {w['attention']} "
                 f"| {w['tokens_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f}) "
                 f"| {pct(w['mfu_nominal'])} | {pct(w['fraction_of_matmul_peak'])} | {gib(w['peak_memory_bytes'])} "
                 f"| {gib(w['xla_total_bytes'])} |")
if reference:
    lines += ["", f"Levanter's own train_lm, GPT-2 small, batch {reference['batch']} ({reference['tokens_per_step']:,} "
              f"tokens/step): {reference['tokens_per_s']:,.0f} tokens/s, MFU {pct(reference['mfu'])} ({reference['source']})"]
status = open(os.path.join(out, "status.tsv")).read()
text = "\n".join(lines) + "\n\nsteps (name, exit status, seconds):\n\n" + status
open(os.path.join(out, "summary.md"), "w").write(text)
print(text)
if not rows:
    sys.exit("no speed results to sum up")
PY
fi

echo "results: $OUT (status.tsv, summary.md)"
exit "$FAILED"
