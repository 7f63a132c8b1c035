"""Fine-tuning at other depths (the paper's Fig. 6) at small scale: does a DiffEqFormer pretrained with N
steps and fine-tuned as an M-layer model beat a GPT-2 pretrained and fine-tuned at the larger depth?

1. Pretraining (`benchmarks/compare/finetune_pretrain.yaml` through `qkvflow bench compare`, checkpoints
   kept): the DiffEqFormer with N Euler steps and GPT-2 at N and 4N/3 layers, on pydoc, every seed.
2. Fine-tuning (`qkvflow sweep`, one per pretrained run): the DiffEqFormer discretised at
   M in {N/2, 2N/3, N, 4N/3}, each GPT-2 at its own depth, with LoRA and full fine-tuning, on a
   different domain: Tiny Shakespeare's text with pydoc's byte-level BPE tokenizer (Python docs ->
   plays, as the paper goes OpenWebText -> WikiText-103). Learning rates are fixed beforehand and the
   same for both models (nothing is selected), so the loss after fine-tuning is measured on the test
   half of Tiny Shakespeare's validation text.
3. The report pairs, seed by seed, ODE(M) with GPT-2 at max(N, M) layers under the same method
   (qkvflow/bench/comparison/stats.py: mean difference and its 95% t interval).

    PYTHONPATH=. python benchmarks/finetune_depths.py --workdir W --out benchmarks/results/NAME

Rerunning the command continues where it stopped (the compare study and the sweeps are resumable).
"""

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from qkvflow.bench.comparison import stats
from qkvflow.bench.comparison.study import run_id

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "benchmarks" / "compare" / "finetune_pretrain.yaml"
METHODS = ("lora", "full")
LEARNING_RATES = {"lora": 1e-3, "full": 3e-4}  # the quickstart sweep's, fixed beforehand


def depths(n: int) -> list[int]:
    """M in {N/2, 2N/3, N, 4N/3}, the paper's fractions (N = 18: 9, 12, 18, 24); N must make them whole."""
    if n % 6:
        raise ValueError(f"N={n}: expected a multiple of 6, so that N/2, 2N/3 and 4N/3 are whole")
    return [n // 2, 2 * n // 3, n, 4 * n // 3]


def layers(study: dict) -> tuple[str, int, dict[int, str]]:
    """(ODE model name, N, {layers: GPT-2 model name}) of the pretraining study."""
    ode = [m for m, o in study["models"].items() if "ode" in o["model"]]
    if len(ode) != 1:
        raise ValueError(f"{STUDY}: expected exactly one ODE model, got {ode}")
    gpts = {o["model"]["num_layers"]: m for m, o in study["models"].items() if "num_layers" in o["model"]}
    return ode[0], study["models"][ode[0]]["model"]["ode"]["num_steps"], gpts


def finetune_config(
    pretrain: Path, rid: str, out: Path, cells: list[int], seed: int, iters: int, corpora: dict
) -> dict:
    """The `qkvflow sweep` config of one pretrained run: its depths x both methods."""
    component = {"source": {"type": "url", "train_urls": corpora["train"], "validation_urls": [corpora["test"]]}}
    return {
        "pretrained": {"config_path": str(pretrain / "configs" / f"{rid}.yaml"), "checkpoint": str(pretrain / "checkpoints" / rid)},
        "steps": cells[0],
        "finetune": "lora",
        "lora": {"r": 8, "alpha": 16.0, "a_init_mode": "random", "zero_init_b": True},
        "epochs": 10,
        "data_seed": seed,
        "loss_curve": None,
        "corpus": None,
        "data": {
            "components": {"shakespeare": component},
            "tokenizer": corpora["tokenizer"],
            "cache_dir": str(out / "cache"),  # this study's own: train and test of Tiny Shakespeare, pydoc's BPE
            "shuffle": True,
        },
        "trainer": {
            "id": rid, "seed": seed, "num_train_steps": iters, "train_batch_size": 16, "steps_per_eval": iters,
            "max_eval_batches": None, "per_device_eval_parallelism": 64, "mp": "p=f32,c=f32",
            "require_accelerator": False, "watch": {"interval": 0},
            "tracker": {"type": "jsonl", "path": str(out / "runs")},
            "checkpointer": {"base_path": str(out / "checkpoints"), "save_interval": "10m"},
            "log_dir": str(out / "logs"),
        },
        "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.0, "warmup": 0.05, "min_lr_ratio": 0.1, "lr_schedule": "cosine"},
        "sweep": {"depths": cells, "methods": list(METHODS), "learning_rate": dict(LEARNING_RATES), "out_dir": str(out / "sweeps" / rid)},
    }  # fmt: skip


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    print(" ".join(cmd), flush=True)
    with open(log, "a") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode:
            raise SystemExit(f"failed: {' '.join(cmd)} (log: {log})")


def _corpora(root: str) -> dict:
    from qkvflow.data.corpora import prepare_corpus

    pydoc = prepare_corpus("pydoc", root)
    plays = prepare_corpus("tinyshakespeare", root)
    return {
        "train": plays.train_urls,
        "test": str(Path(plays.tokenizer).parent / "test.jsonl"),
        "tokenizer": pydoc.tokenizer,
    }


def rows_of(sweep_csv: Path) -> dict:
    """{(method, M): row} of a sweep table, losses as floats."""
    with open(sweep_csv) as f:
        return {
            (r["method"], int(r["M"])): {k: float(r[k]) for k in ("initial_eval_loss", "eval_loss")}
            for r in csv.DictReader(f)
        }


def report(results: dict, ode: str, n: int, gpts: dict[int, str], seeds: list[int]) -> dict:
    """`results[model][seed][(method, M)]` = {initial_eval_loss, eval_loss} -> one row per method and M:
    the ODE at M against GPT-2 at max(N, M) layers, paired by seed."""
    out = []
    for method in METHODS:
        for m in depths(n):
            gpt = gpts[max(n, m)]
            after = {s: results[ode][s][(method, m)]["eval_loss"] for s in seeds}
            before = {s: results[ode][s][(method, m)]["initial_eval_loss"] for s in seeds}
            base = {s: results[gpt][s][(method, max(n, m))]["eval_loss"] for s in seeds}
            base_before = {s: results[gpt][s][(method, max(n, m))]["initial_eval_loss"] for s in seeds}
            d = stats.paired_difference(after, base)
            so, sb, s0, sb0 = (stats.summarise(list(x.values())) for x in (after, base, before, base_before))
            out.append({
                "method": method, "M": m, "baseline": gpt, "ode_before": [s0.mean, s0.std], "ode": [so.mean, so.std],
                "gpt2_before": [sb0.mean, sb0.std], "gpt2": [sb.mean, sb.std], "difference": d.mean, "ci95": [d.low, d.high], "verdict": d.verdict,
            })  # fmt: skip
    beats = [r["verdict"] == "lower" for r in out]
    worse = [r["verdict"] == "higher" for r in out]
    claim = "held" if all(beats) else "did not hold" if any(worse) else "inconclusive"
    return {"ode": ode, "N": n, "seeds": seeds, "learning_rates": LEARNING_RATES, "rows": out, "claim": claim}


def markdown(result: dict) -> str:
    f = lambda ms: f"{ms[0]:.4f} ± {ms[1] or 0:.4f}"  # noqa: E731
    lines = [
        f"Test loss after fine-tuning (Tiny Shakespeare's text, pydoc's tokenizer), seeds {result['seeds']}; "
        f"the DiffEqFormer pretrained with N = {result['N']} steps and discretised at M, GPT-2 pretrained and "
        f"fine-tuned at max(N, M) layers; learning rates {result['learning_rates']} (fixed beforehand). "
        f"Claim (ODE below GPT-2 in every row): **{result['claim']}**.",
        "",
        "| method | M | ODE before | ODE after (mean ± sd) | GPT-2 | GPT-2 before | GPT-2 after | Δ [95% CI] | verdict |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lo, hi = r["ci95"]
        interval = "-" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"
        lines.append(
            f"| {r['method']} | {r['M']} | {r['ode_before'][0]:.4f} | {f(r['ode'])} | {r['baseline']} "
            f"| {r['gpt2_before'][0]:.4f} | {f(r['gpt2'])} "
            f"| {r['difference']:+.4f} {interval} | {r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, colour in zip(METHODS, ("C0", "C1")):
        rows = [r for r in result["rows"] if r["method"] == method]
        ax.errorbar([r["M"] for r in rows], [r["ode"][0] for r in rows], yerr=[r["ode"][1] or 0 for r in rows],
                    color=colour, marker="o", capsize=3, label=f"DiffEqFormer (N={result['N']}), {method}")  # fmt: skip
        gpt = {r["M"] if r["M"] > result["N"] else result["N"]: r["gpt2"] for r in rows}
        ax.errorbar(list(gpt), [v[0] for v in gpt.values()], yerr=[v[1] or 0 for v in gpt.values()], color=colour,
                    marker="s", linestyle="none", capsize=3, label=f"GPT-2 at its depth, {method}")  # fmt: skip
    ax.axvline(result["N"], color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("layers when fine-tuned (M)")
    ax.set_ylabel("test loss after fine-tuning")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="work folder (pretrain/ and finetune/ inside); rerun to continue")
    p.add_argument("--out", required=True, help="writes OUT.json, OUT.md and OUT.png")
    p.add_argument("--iters", type=int, default=300, help="pretraining steps")
    p.add_argument("--finetune_iters", type=int, default=150)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--corpus_root", default=str(ROOT / "cache" / "corpora"))
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    study = yaml.safe_load(STUDY.read_text())
    ode, n, gpts = layers(study)
    (lr,) = study["learning_rates"]
    work = Path(args.workdir).resolve()
    pretrain, tune = work / "pretrain", work / "finetune"
    _run([sys.executable, "-m", "qkvflow", "bench", "compare", str(STUDY), "--workdir", str(pretrain), "--iters",
          str(args.iters), "--seeds", args.seeds, "--keep_checkpoints", "--corpus_root", args.corpus_root,
          "--out_dir", str(work / "pretrain_report")], work / "pretrain.log")  # fmt: skip
    corpora = _corpora(args.corpus_root)
    cells = {ode: depths(n), **{g: [k] for k, g in gpts.items()}}
    results: dict = {}
    for model, ms in cells.items():
        for seed in seeds:
            rid = run_id(model, lr, seed)
            config = tune / "configs" / f"{rid}.yaml"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(
                yaml.safe_dump(finetune_config(pretrain, rid, tune, ms, seed, args.finetune_iters, corpora))
            )
            _run(
                [sys.executable, "-m", "qkvflow", "sweep", "--config_path", str(config)],
                tune / "logs" / f"{rid}.sweep.log",
            )
            results.setdefault(model, {})[seed] = rows_of(tune / "sweeps" / rid / "sweep.csv")
    result = report(results, ode, n, gpts, seeds)
    result.update(iters=args.iters, finetune_iters=args.finetune_iters, pretraining_learning_rate=lr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(result)
    with open(f"{args.out}.md", "w") as f:
        f.write(table)
    plot(result, f"{args.out}.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
