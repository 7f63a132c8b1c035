"""Halting heads on an aligned exits model (Depth-Adaptive Transformer, Elbayad et al., ICLR 2020).

The paper's claim: geometric-like halting trained towards the correctness oracle keeps the quality of
the full model at about 1.4-2 average exits out of 6, and a larger lambda gives earlier exits.

For each oracle x lambda this trains a halting head with `qkvflow train` (the halting phase of
`halting_gpt2`: the aligned `adaptive_gpt2` checkpoint's trunk and exits frozen, only the head
trains; qkvflow.training.halting_phase), then evaluates it on the test half with copy-up: test loss,
accuracy, average exit, FLOPs per token (qkvflow.evaluation.exits.ExitCosts.halting: 2 d per test),
and the average exit of the oracle the head was trained towards. The aligned model's fixed exits
(every token at exit n) are the reference rows. Runs already trained in --workdir are reused.

    PYTHONPATH=. python benchmarks/halting.py \\
        --aligned_config W/configs/aligned_6-lr0.002-s0.yaml --aligned_checkpoint W/checkpoints/aligned_6-lr0.002-s0

writes OUT_DIR/NAME.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aligned_config", required=True, help="the aligned adaptive_gpt2 run's qkvflow train config")
    p.add_argument("--aligned_checkpoint", required=True, help="its checkpoint folder (run or step-N)")
    p.add_argument("--workdir", default="cache/halting_study")
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="halting")
    p.add_argument(
        "--corpus_root", default=str(ROOT / "cache" / "corpora"), help="where this study's corpus cache goes"
    )
    p.add_argument("--kind", default="geometric", choices=["geometric", "multinomial"])
    p.add_argument("--oracles", nargs="+", default=["correctness", "likelihood"])
    p.add_argument("--lams", nargs="+", type=float, default=[0.05, 0.1, 0.3])
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--tau", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--learning_rate", type=float, default=5e-3)
    return p


def run_config(args, oracle: str, lam: float, workdir: Path) -> tuple[str, Path]:
    """(run id, config path) of one halting phase: the aligned config with the halting family and keys."""
    config = yaml.safe_load(Path(args.aligned_config).read_text())
    run_id = f"{args.kind}-{oracle}-lam{lam:g}"
    halting = {"kind": args.kind, "oracle": oracle, "lam": lam, "sigma": args.sigma, "tau": args.tau}
    config["model"] = {**config["model"], "type": "halting_gpt2", "halting": halting}
    t = config["trainer"]
    t.update(id=run_id, num_train_steps=args.steps, max_eval_batches=0)  # evaluated here, on the test half
    t["initialize_from"] = str(Path(args.aligned_checkpoint).resolve())
    t["checkpointer"] = {**t.get("checkpointer", {}), "base_path": str(workdir / "checkpoints")}
    t["tracker"] = {"type": "jsonl", "path": str(workdir / "runs")}
    t["log_dir"] = str(workdir / "logs")
    config["optimizer"] = {**config["optimizer"], "learning_rate": args.learning_rate}
    config["loss_curve"] = None
    if "corpus" in config:  # the token caches of this study, not the aligned run's folder
        config["corpus"] = {**config["corpus"], "root": str(Path(args.corpus_root).resolve())}
    path = workdir / "configs" / f"{run_id}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return run_id, path


def train(run_id: str, config_path: Path, workdir: Path, steps: int) -> float:
    """Train the halting phase unless its step-`steps` checkpoint exists; returns the wall time (0: reused)."""

    def finished() -> bool:  # step-N holds the state after N steps
        return (workdir / "checkpoints" / run_id / f"step-{steps}").is_dir()

    if finished():
        return 0.0
    start = time.perf_counter()
    log = workdir / "logs" / f"{run_id}.out"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "qkvflow", "train", "--config_path", str(config_path)]
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode != 0 and not finished():
        raise SystemExit(f"halting run {run_id} failed (exit {done.returncode}); see {log}")
    if done.returncode != 0:  # seen once: a crash in interpreter teardown after the final checkpoint
        print(f"  {run_id}: exit {done.returncode} after its final checkpoint was saved; see {log}", flush=True)
    return time.perf_counter() - start


def load(config_path: Path, checkpoint: str, Vocab):
    """The halting model: the aligned trunk (trainer.initialize_from) and the head from `checkpoint`."""
    import draccus
    import equinox as eqx
    import jax
    import jax.random as jrandom
    import levanter.checkpoint
    from levanter.trainer_state import make_floating_point_trainable_filter

    from qkvflow.runs.config import TrainConfig
    from qkvflow.training import halting_phase

    config = draccus.parse(TrainConfig, config_path=str(config_path), args=[])
    _, model, is_trainable = halting_phase.prepare(config, Vocab, jrandom.PRNGKey(0))
    head, frozen = eqx.partition(model, make_floating_point_trainable_filter(is_trainable))
    path = levanter.checkpoint.discover_latest_checkpoint(checkpoint)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with jax.set_mesh(mesh):
        head = levanter.checkpoint.load_checkpoint(
            eqx.filter_eval_shape(lambda: head), path, subpath="model", mesh=mesh
        )
    return eqx.combine(head, frozen)


def test_batches(config_path: Path):
    """The test half of the held-out text as (tokens, loss_weight) pairs, and the vocabulary axis."""
    import draccus
    import haliax as hax
    import jax.numpy as jnp

    from qkvflow.evaluation import perplexity
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.corpus import with_corpus

    config = with_corpus(
        draccus.parse(
            TrainConfig,
            config_path=str(config_path),
            args=["--corpus.eval_split", "test", "--trainer.max_eval_batches", "null"],
        )
    )
    config.data.build_caches("validation")
    tokenizer = config.data.the_tokenizer
    evaluator = perplexity.make_evaluator(config, config.model.max_Pos, tokenizer)
    batches = [
        (hax.named(jnp.asarray(np.asarray(b.tokens.array)), b.tokens.axes),
         hax.named(jnp.asarray(np.asarray(b.loss_weight.array), jnp.float32), b.tokens.axes))
        for b, _tags in evaluator.loader
    ]  # fmt: skip
    return batches, hax.Axis("vocab", len(tokenizer))


def _sums():
    import equinox as eqx
    import haliax as hax
    import jax.numpy as jnp

    from qkvflow.evaluation import exits as ex
    from qkvflow.models.related import halting as H

    @eqx.filter_jit
    def halting_sums(model, tokens, weight):
        """The exits module's per-batch sums at the head's exits, and the oracle's exits' weights."""
        sums = ex.exit_sums(model, tokens, weight, model.halting_rule(tokens))
        Pos = tokens.axes[-1]
        w = weight * hax.logical_not(hax.nn.one_hot(-1, Pos, dtype=bool)).astype(weight.dtype)
        target = model.oracle(tokens, model.exit_states(tokens), w)
        sums["oracle_per_exit"] = jnp.stack([hax.sum(w * (target == n)).array for n in range(model.num_exits)])
        return sums

    return halting_sums, ex, H


def head_cost(costs, kind: str):
    """F(e) of a head's exit at e: the exits module's geometric cost (a 2 d test at every exit before the
    last), or for multinomial halting one 2 d N softmax input instead of the tests."""
    if kind == "geometric":
        return costs.halting
    return lambda e: costs.halting(e) + (costs.num_exits - np.minimum(e, costs.num_exits - 1)) * costs.test


def evaluate(args, runs: list[tuple[str, Path, float]], workdir: Path) -> dict:
    import logging

    from qkvflow.training import halting_phase

    logging.getLogger("levanter").setLevel(logging.ERROR)  # checkpoint loading's info lines

    halting_sums, ex, _ = _sums()
    batches, Vocab = test_batches(runs[0][1])
    rows = []
    aligned = None
    for run_id, config_path, wall in runs:
        model = load(config_path, str(workdir / "checkpoints" / run_id), Vocab)
        if aligned is None:  # the fixed exits of the aligned model (the same trunk in every run)
            trunk = halting_phase.load_exits_model(model.config, Vocab, args.aligned_checkpoint)
            per_exit = ex.summary(ex.accumulate(ex.per_exit_sums(trunk, t, w) for t, w in batches))
            costs = ex.ExitCosts.of(model.config, Vocab.size)
            aligned = [
                {"name": f"aligned, every token at exit {n}", "avg_exit": float(n), "test_loss": per_exit["loss"][n - 1],
                 "test_accuracy": per_exit["accuracy"][n - 1], "flops": costs.fixed(n)}
                for n in range(1, model.num_exits + 1)
            ]  # fmt: skip
        total = ex.accumulate(halting_sums(model, t, w) for t, w in batches)
        s = ex.summary(total)
        oracle = np.asarray(total["oracle_per_exit"]) / total["weight"]
        h = model.config.halting
        rows.append(
            {"name": run_id, "kind": h.kind, "oracle": h.oracle, "lam": h.lam, "sigma": h.sigma, "tau": h.tau,
             "avg_exit": s["avg_exit"], "test_loss": s["loss"], "test_accuracy": s["accuracy"],
             "flops": ex.mean_flops(total["per_exit"], head_cost(costs, h.kind)), "exit_fractions": s["exit_fractions"],
             "oracle_avg_exit": float(np.sum(oracle * np.arange(1, len(oracle) + 1))),
             "oracle_exit_fractions": oracle.tolist(), "train_wall_s": round(wall, 1)}
        )  # fmt: skip
    return {"halting": rows, "aligned": aligned, "vocab": Vocab.size, "test_tokens": s["tokens"], "steps": args.steps,
            "learning_rate": args.learning_rate, "aligned_checkpoint": args.aligned_checkpoint}  # fmt: skip


def markdown(result: dict) -> str:
    lines = [
        f"Test half of Tiny Shakespeare ({result['test_tokens']:.0f} target tokens), one aligned model, one seed per "
        f"halting head ({result['steps']} halting-phase steps, lr {result['learning_rate']:g}). FLOPs per token: "
        f"forward, V={result['vocab']}, qkvflow.evaluation.exits.",
        "",
        "| exits by | oracle | lambda | avg exit | oracle's avg exit | test loss | test accuracy | MFLOPs/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["halting"]:
        lines.append(
            f"| {r['kind']} head (tau {r['tau']:g}) | {r['oracle']} | {r['lam']:g} | {r['avg_exit']:.3f} | "
            f"{r['oracle_avg_exit']:.3f} | {r['test_loss']:.4f} | {r['test_accuracy']:.4f} | {r['flops'] / 1e6:.3f} |"
        )
    for r in result["aligned"]:
        lines.append(
            f"| {r['name']} | - | - | {r['avg_exit']:.3f} | - | {r['test_loss']:.4f} | {r['test_accuracy']:.4f} | "
            f"{r['flops'] / 1e6:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=110)
    pts = [(r["avg_exit"], r["test_loss"]) for r in result["aligned"]]
    ax.plot(*zip(*pts), "o-", color="gray", label="aligned model, every token at exit n")
    for oracle, marker, size in (("correctness", "^", 11), ("likelihood", "s", 6)):  # sizes: coinciding points show
        rows = [r for r in result["halting"] if r["oracle"] == oracle]
        if rows:
            xs, ys = [r["avg_exit"] for r in rows], [r["test_loss"] for r in rows]
            ax.plot(xs, ys, marker, markersize=size, label=f"halting, {oracle}")
            for r in rows:
                ax.annotate(f"λ={r['lam']:g}", (r["avg_exit"], r["test_loss"]), fontsize=8, xytext=(4, 4),
                            textcoords="offset points")  # fmt: skip
    ax.set_xlabel("average exit (blocks)")
    ax.set_ylabel("test loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    workdir = Path(args.workdir).resolve()
    start = time.perf_counter()
    runs = []
    for oracle in args.oracles:
        for lam in args.lams:
            run_id, path = run_config(args, oracle, lam, workdir)
            print(f"halting phase {run_id} ...", flush=True)
            runs.append((run_id, path, train(run_id, path, workdir, args.steps)))
    result = evaluate(args, runs, workdir)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out / f"{args.name}.md").write_text(table)
    plot(result, out / f"{args.name}.png")
    print(table)
    print(f"wrote {out / args.name}.{{md,json,png}} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
