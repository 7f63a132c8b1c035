"""Depth-adaptive exits in continuous depth on Tiny Shakespeare: train, sweep the halting threshold, report.

    python benchmarks/ode_exits.py --workdir W [--iters 300] [--seeds 0,1] [--lr 2e-3] [--steps 6]

Trains two DiffEqFormers of the quality benchmark's shape (benchmarks/compare/base_tinyshakespeare.yaml:
hidden 128, 4 heads, context 64, batch 12, d_emb 64 as the `ode` row of
benchmarks/compare/tinyshakespeare.yaml) on an Euler grid of `--steps` steps, through `qkvflow train`
with the configs `qkvflow bench compare` would write (`qkvflow.bench.comparison.study.run_config`;
selection split for the run's own evaluation): `aligned` (`exits: aligned`, the mean loss of the exits at
t_k = k / N) and `plain` (the loss at t = 1 only). Then, for each trained model and each split
(selection, test; `corpus.eval_split`; its first `--max_sequences` sequences of 64), the per-exit losses and the halting sweep over `--taus`
(`qkvflow.evaluation.ode_halting`); tau is chosen on selection (fewest mean NFE within `--slack` nats of the
unhalted loss) and reported on test. Writes W/ode_exits.{md,json,png}. Rerunnable: finished runs are
resumed (nothing left to train) and only evaluated again; `--eval_only` skips even the resume.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "benchmarks" / "compare" / "base_tinyshakespeare.yaml"
TAUS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, math.inf)


def model_configs(steps: int) -> dict:
    ode = {"type": "diffeqformer_gpt2", "max_seq_len": 64, "hidden_dim": 128, "num_heads": 4, "time_embed_dim": 64}
    ode["ode"] = {"num_steps": steps, "solver": "euler"}
    return {"aligned": {"model": {**ode, "exits": "aligned"}}, "plain": {"model": ode}}


def train(study: dict, name: str, lr: float, seed: int, workdir: Path, corpus_root: str) -> tuple[Path, float]:
    from qkvflow.bench.comparison.study import run_config, run_id

    config = run_config(study, name, lr, seed, workdir, corpus_root)
    path = workdir / "configs" / f"{run_id(name, lr, seed)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / "logs" / f"{run_id(name, lr, seed)}.out"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log, "a") as f:
        rc = subprocess.call([sys.executable, "-m", "qkvflow", "train", "--config_path", str(path)], stdout=f, stderr=f)
    if rc != 0:
        sys.exit(f"qkvflow train failed for {path} (rc {rc}); see {log}")
    return path, time.time() - start


def eval_batches(config, Pos, max_sequences: int, batch_size: int = 64):
    """The split's first `max_sequences` held-out sequences (as the run's evaluation reads them), in
    batches of `batch_size`; the last one padded with weight-0 copies (one compiled shape)."""
    import haliax as hax
    from levanter.models.lm_model import LmExample

    if not config.data.build_caches("validation"):
        sys.exit("no validation set")
    (dataset, _tags), *_ = config.data.tagged_eval_sets(Pos)
    ds = dataset.as_sync_dataset()
    examples = list(ds.get_batch(list(range(min(len(ds), max_sequences)))))
    Batch = hax.Axis("batch", batch_size)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        weights = [e.loss_weight for e in chunk]
        while len(chunk) < batch_size:
            chunk.append(chunk[0])
            weights.append(hax.zeros_like(chunk[0].loss_weight))
        yield (
            LmExample(
                tokens=hax.stack(Batch, [e.tokens for e in chunk]),
                loss_weight=hax.stack(Batch, weights),
                attn_mask=chunk[0].attn_mask,
            ),
            sum(float(w.array.sum() > 0) for w in weights),
        )


def evaluate_run(config_path: Path, checkpoint: Path, taus, max_sequences: int) -> dict:
    from qkvflow.evaluation import ode_halting
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.configfile import parse
    from qkvflow.runs.corpus import with_corpus
    from qkvflow.runs.model import load_model

    out = {}
    for split in ("selection", "test"):
        config = parse(TrainConfig, ["--config_path", str(config_path), "--corpus.eval_split", split], "train")
        config = with_corpus(config)
        model, _ = load_model(config, str(checkpoint))
        batches = list(eval_batches(config, model.Pos, max_sequences))
        start = time.time()
        out[split] = ode_halting.evaluate(model, [b for b, _ in batches], taus, context_length=model.config.max_seq_len)
        out[split]["eval_seconds"] = time.time() - start
        out[split]["sequences"] = int(sum(count for _, count in batches))
    return out


def fmt_tau(tau: float) -> str:
    return "never" if math.isinf(tau) else f"{tau:g}"


def markdown(result: dict) -> str:
    lines = []
    runs = result["runs"]
    n = result["steps"]
    lines.append(f"### Per-exit test loss (Euler, N = {n}; no halting)\n")
    header = "| run | " + " | ".join(f"t={k}/{n}" for k in range(1, n + 1)) + " |"
    lines += [header, "|---|" + "---:|" * n]
    for rid, r in runs.items():
        lines.append(f"| {rid} | " + " | ".join(f"{v:.4f}" for v in r["eval"]["test"]["exit_losses"]) + " |")
    for rid, r in runs.items():
        test, sel = r["eval"]["test"], r["eval"]["selection"]
        lines.append(f"\n### Halting sweep, {rid} (test split; tau chosen on selection: {fmt_tau(r['chosen_tau'])})\n")
        lines.append(
            "| tau | selection loss | test loss | mean NFE/token | NFE saved | mean exit time | halted | FLOPs/token |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for srow, row in zip(sel["rows"], test["rows"]):
            mark = " **(chosen)**" if row["tau"] == r["chosen_tau"] else ""
            lines.append(
                f"| {fmt_tau(row['tau'])}{mark} | {srow['loss']:.4f} | {row['loss']:.4f} | {row['mean_nfe']:.3f} | "
                f"{100 * row['nfe_saved']:.1f}% | {row['mean_exit_time']:.3f} | {100 * row['halted_fraction']:.1f}% | "
                f"{row['flops_per_token'] / 1e6:.3f}M |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for rid, r in result["runs"].items():
        test = r["eval"]["test"]
        axes[0].plot(test["exit_times"], test["exit_losses"], marker="o", label=rid)
        axes[1].plot([x["mean_nfe"] for x in test["rows"]], [x["loss"] for x in test["rows"]], marker="o", label=rid)
        axes[2].plot(
            [x["flops_per_token"] / 1e6 for x in test["rows"]], [x["loss"] for x in test["rows"]], marker="o", label=rid
        )
    axes[0].set(xlabel="exit time t_k", ylabel="test loss (nats)", title="per-exit loss, no halting")
    axes[1].set(xlabel="mean NFE per token", ylabel="test loss (nats)", title="halting sweep over tau")
    axes[2].set(xlabel="forward MFLOPs per token", ylabel="test loss (nats)", title="halting sweep over tau")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--seeds", default="0")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--taus", default=",".join(fmt_tau(t) for t in TAUS), help="comma-separated; 'never': no halting")
    p.add_argument("--slack", type=float, default=0.01, help="nats above the unhalted selection loss tau may cost")
    p.add_argument("--corpus_root", default=str(ROOT / "cache" / "corpora"))
    p.add_argument("--max_sequences", type=int, default=384, help="held-out sequences per split evaluated")
    p.add_argument("--train_only", action="store_true")
    p.add_argument("--eval_only", action="store_true", help="evaluate the runs an earlier invocation trained")
    args = p.parse_args(argv)
    workdir = Path(args.workdir).resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    taus = [math.inf if t.strip() == "never" else float(t) for t in args.taus.split(",")]
    study = {"base": str(BASE), "models": model_configs(args.steps), "iters": args.iters}
    result = {"command": " ".join(["python benchmarks/ode_exits.py", *(argv if argv is not None else sys.argv[1:])]),
              "steps": args.steps, "iters": args.iters, "lr": args.lr, "slack": args.slack, "runs": {}}  # fmt: skip
    from qkvflow.bench.comparison.study import run_id

    for seed in seeds:
        for name in ("aligned", "plain"):
            rid = run_id(name, args.lr, seed)
            if args.eval_only:  # the runs' configs as written by an earlier invocation
                path, seconds = workdir / "configs" / f"{rid}.yaml", 0.0
                result["runs"][rid] = {"config": str(path), "train_seconds_this_call": seconds}
                continue
            path, seconds = train(study, name, args.lr, seed, workdir, args.corpus_root)
            print(f"{rid}: trained ({seconds:.0f} s wall, this invocation)", flush=True)
            result["runs"][rid] = {"config": str(path), "train_seconds_this_call": seconds}
    if args.train_only:
        return 0
    from qkvflow.evaluation.ode_halting import choose_tau

    for rid, r in result["runs"].items():
        r["eval"] = evaluate_run(Path(r["config"]), workdir / "checkpoints" / rid, taus, args.max_sequences)
        r["chosen_tau"] = choose_tau(r["eval"]["selection"], args.slack)
        print(f"{rid}: evaluated ({r['eval']['test']['eval_seconds']:.0f} s on test)", flush=True)
    result["uptime"] = os.popen("uptime").read().strip()
    (workdir / "ode_exits.json").write_text(json.dumps(result, indent=1, default=str))
    (workdir / "ode_exits.md").write_text(markdown(result))
    plot(result, workdir / "ode_exits.png")
    print(markdown(result))
    for name in ("md", "json", "png"):
        print(f"wrote {workdir / f'ode_exits.{name}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
