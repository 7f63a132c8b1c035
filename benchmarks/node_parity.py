"""Reproduce Tables 1-2 of the N-ODE Transformer paper (Baier-Reinio & De Sterck, 2020) on PARITY.

Full-batch Adam (optax) on all strings of length <= max_length; reports the best training accuracy,
the wall time to reach it, and (N-ODE) solver NFE per string against length and correctness. Writes
JSON and a markdown table under --out. A small training entry point built on optax directly (not
`qkvflow train`: the classification loss and per-string solves do not fit the LM trainer).

    python benchmarks/node_parity.py --max-length 6 --models vanilla node --lrs 1e-2 3e-3 --seeds 0 1 2 --steps 2000

`--summarise FILE...` reads results (a results JSON, or a log of the one-line JSON results printed per run)
and prints the per-(model, length, lr) table over seeds: best training accuracy (mean, sd, min, max), time to
best, wall time, NFE per string by length and by correctness.
"""

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
import optax

from qkvflow.data.parity import parity_dataset
from qkvflow.models.related.node_transformer import NodeTransformerConfig, init, loss_fn


def run(model, lr, seed, max_length, steps, lam, causal):
    data = parity_dataset(max_length, causal=causal)
    config = NodeTransformerConfig(ode=model == "node", max_len=data.tokens.shape[1], kinetic_lambda=lam, causal=causal)
    params = init(config, jax.random.PRNGKey(seed))
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, data.tokens, data.lengths, data.labels, config
        )
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss, aux

    start, best, best_t, best_step, best_aux, history = time.time(), -1.0, 0.0, 0, None, []
    for i in range(steps):
        params, state, loss, (correct, nfe) = step(params, state)
        acc = float(np.mean(correct))  # accuracy of the parameters before this update
        history.append((i, float(loss), acc))
        if acc > best:
            best, best_t, best_step = acc, time.time() - start, i
            best_aux = (np.asarray(correct), np.asarray(nfe))
        if (i + 1) % 25 == 0:  # progress on stderr: a long run killed early still says how far it got
            print(f"progress {model} L<={max_length} seed {seed}: step {i + 1} acc {acc:.3f} best {best:.3f} "
                  f"(step {best_step}) {time.time() - start:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    correct, nfe = best_aux
    by_len = {int(n): float(nfe[data.bits == n].mean()) for n in np.unique(data.bits)}
    return {
        "model": model, "lr": lr, "seed": seed, "max_length": max_length, "steps": steps, "lambda": lam,
        "best_train_acc": best, "best_step": best_step, "time_to_best_s": best_t, "wall_s": time.time() - start,
        "nfe_by_length": by_len if model == "node" else None,
        "nfe_correct": float(nfe[correct].mean()) if model == "node" and correct.any() else None,
        "nfe_wrong": float(nfe[~correct].mean()) if model == "node" and (~correct).any() else None,
        "final_loss": history[-1][1],
    }  # fmt: skip


def plot(results, path):
    """NFE per string against string length, one line per N-ODE run (the paper's depth-adaptivity view)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in results:
        if r["nfe_by_length"]:
            lengths = sorted(int(k) for k in r["nfe_by_length"])
            nfe = [r["nfe_by_length"][k] for k in sorted(r["nfe_by_length"], key=int)]
            ax.plot(lengths, nfe, marker="o", label=f"lr={r['lr']} seed={r['seed']} acc={r['best_train_acc']:.2f}")
    ax.set_xlabel("string length L")
    ax.set_ylabel("NFE per string (both blocks)")
    if any(r["nfe_by_length"] for r in results):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load(paths):
    """Result dicts from results JSON files or logs with one JSON result per line."""
    results = []
    for path in paths:
        text = open(path).read()
        if text.lstrip().startswith("["):
            results += json.loads(text)
        else:
            results += [json.loads(line) for line in text.splitlines() if line.startswith('{"model"')]
    return results


def summarise(results):
    """Markdown rows over seeds per (max_length, model, lr, steps)."""
    groups = {}
    for r in results:
        groups.setdefault((r["max_length"], r["model"], r["lr"], r["steps"]), []).append(r)
    lines = ["| length | model | lr | steps | seeds | best train acc: mean (sd) [min, max] | time to best (s) | wall (s) "
             "| NFE per string by length | NFE correct / wrong |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (length, model, lr, steps), rs in sorted(groups.items()):
        acc = np.array([r["best_train_acc"] for r in rs]) * 100
        sd = f"{acc.std(ddof=1):.1f}" if len(rs) > 1 else "-"
        nfe = "-"
        if rs[0]["nfe_by_length"]:
            keys = sorted(rs[0]["nfe_by_length"], key=int)
            nfe = ", ".join(f"{k}: {np.mean([r['nfe_by_length'][k] for r in rs]):.1f}" for k in keys)
        right = [r["nfe_correct"] for r in rs if r["nfe_correct"] is not None]
        wrong = [r["nfe_wrong"] for r in rs if r["nfe_wrong"] is not None]
        split = (
            "-"
            if not rs[0]["nfe_by_length"]
            else (f"{np.mean(right):.1f} / {np.mean(wrong):.1f}" if wrong else f"{np.mean(right):.1f} / (none wrong)")
        )
        lines.append(
            f"| <= {length} | {model} | {lr} | {steps} | {len(rs)} | {acc.mean():.1f} ({sd}) [{acc.min():.1f}, "
            f"{acc.max():.1f}] | {np.mean([r['time_to_best_s'] for r in rs]):.0f} | "
            f"{np.mean([r['wall_s'] for r in rs]):.0f} | {nfe} | {split} |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-length", type=int, default=6)
    ap.add_argument("--models", nargs="+", default=["vanilla", "node"])
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-2, 3e-3, 1e-3])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kinetic-lambda", type=float, default=4.0**-5)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", default="runs/node_parity")
    ap.add_argument("--summarise", nargs="+", metavar="FILE", help="print the table over seeds of these results")
    args = ap.parse_args(argv)
    if args.summarise:
        print(summarise(load(args.summarise)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    for model in args.models:
        for lr in args.lrs:
            for seed in args.seeds:
                r = run(model, lr, seed, args.max_length, args.steps, args.kinetic_lambda, args.causal)
                print(json.dumps(r), flush=True)
                results.append(r)
    tag = f"L{args.max_length}{'_causal' if args.causal else ''}"
    with open(os.path.join(args.out, f"results_{tag}.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, f"table_{tag}.md"), "w") as f:
        f.write(
            "| model | lr | seed | best train acc | time to best (s) | NFE by length |\n|---|---|---|---|---|---|\n"
        )
        for r in results:
            f.write(f"| {r['model']} | {r['lr']} | {r['seed']} | {r['best_train_acc']:.3f} | {r['time_to_best_s']:.1f}"
                    f" | {r['nfe_by_length']} |\n")  # fmt: skip
    plot(results, os.path.join(args.out, f"nfe_{tag}.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
