"""Figures of a run: the loss curve (train and eval loss against step)."""

from qkvflow.runs.tracking import read_metrics


def plot_loss_curve(metrics_jsonl: str, out_png: str, title: str = "") -> str:
    import matplotlib  # here, not at the top: pyplot costs ~0.7 s of every `qkvflow train` start

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = read_metrics(metrics_jsonl)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for key, label, style in (("train/loss", "train", "-"), ("eval/loss", "eval", "o-")):
        points = sorted((s, m[key]) for s, m in steps.items() if key in m)
        if points:
            ax.plot(*zip(*points), style, label=label, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
