"""`qkvflow sweep`: fine-tune one pretrained ODE model at several depths M with several methods.

    qkvflow sweep --config_path configs/finetune/owt_to_wikitext103.yaml [--depths 9,12,18,24] [--methods lora,full]

The config is a `qkvflow finetune` config; its `sweep:` section (depths, methods, out_dir) gives the
grid unless `--depths` / `--methods` do. Each cell is one fine-tune run, in this process, one after
the other, with the run id `<trainer.id>-<method>-M<depth>` (checkpoints, metrics, exports under
that id). A cell whose run has finished (its `finetune_summary.json` says so) is skipped, and an
unfinished one resumes from its checkpoint, so rerunning the same command completes the grid.

Outputs in `sweep.out_dir` (default `sweeps/<trainer.id>`): `sweep.csv` and `sweep.md` (one row per
cell: M, method, trainable and total parameters, validation loss of the discretised model before
fine-tuning, final train loss, validation loss and perplexity after) and
`sweep.png`, validation perplexity against M with one line per method (the paper's Fig. 6).
`sweep.out_dir` is qkvflow's own folder: it is rewritten whole after each cell (`qkvflow.outputs`:
a temporary sibling swapped in), so it must be absent, empty or an earlier sweep's output; that and
every cell's exports are checked before the first cell trains.
"""

import csv
import dataclasses
import os
import sys

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.finetune.run import check_exports, check_values, finetune, read_summary
from qkvflow.training import preflight

KIND = "sweep"

COLUMNS = (
    "M", "method", "trainable_params", "total_params", "initial_eval_loss", "train_loss", "eval_loss", "eval_perplexity",
    "run_id",
)  # fmt: skip
HEADERS = {
    "M": "M",
    "method": "method",
    "trainable_params": "trainable params",
    "total_params": "total params",
    "initial_eval_loss": "validation loss before",
    "train_loss": "final train loss",
    "eval_loss": "validation loss",
    "eval_perplexity": "validation perplexity",
    "run_id": "run id",
}


def run_id(base: str, method: str, depth: int) -> str:
    return f"{base}-{method}-M{depth}"


def cell_config(config, depth: int, method: str):
    trainer = dataclasses.replace(config.trainer, id=run_id(config.trainer.id, method, depth))
    optimizer = config.optimizer
    if method in config.sweep.learning_rate:
        optimizer = dataclasses.replace(optimizer, learning_rate=config.sweep.learning_rate[method])
    return dataclasses.replace(config, steps=depth, finetune=method, trainer=trainer, optimizer=optimizer)


def _row(summary: dict, depth: int, method: str) -> dict:
    return {
        "M": depth,
        "method": method,
        "trainable_params": summary.get("trainable_parameter_count"),
        "total_params": summary.get("parameter_count"),
        "initial_eval_loss": summary.get("initial_eval_loss"),
        "train_loss": summary.get("train_loss"),
        "eval_loss": summary.get("eval_loss"),
        "eval_perplexity": summary.get("eval_perplexity"),
        "run_id": summary.get("run_id"),
    }


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}" if value >= 100 else f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def write_table(rows: list[dict], out_dir: str, title: str = "") -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    csv_path, md_path = os.path.join(out_dir, "sweep.csv"), os.path.join(out_dir, "sweep.md")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})
    with open(md_path, "w") as f:
        if title:
            f.write(f"# {title}\n\n")
        f.write("| " + " | ".join(HEADERS[c] for c in COLUMNS) + " |\n")
        f.write("|" + "|".join("---:" if c not in ("method", "run_id") else "---" for c in COLUMNS) + "|\n")
        for row in rows:
            f.write("| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |\n")
    return csv_path, md_path


def plot_sweep(rows: list[dict], out_png: str, pretrained_steps=None, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
    styles = {"lora": ("o-", "LoRA"), "full": ("s-", "full fine-tuning")}
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted(
            (r["M"], r["eval_perplexity"]) for r in rows if r["method"] == method and r["eval_perplexity"] is not None
        )
        if points:
            style, label = styles.get(method, ("^-", method))
            ax.plot(*zip(*points), style, label=label, markersize=5)
    depths = sorted({r["M"] for r in rows})
    if pretrained_steps is not None:
        ax.axvline(
            pretrained_steps, color="gray", linestyle=":", linewidth=1, label=f"pretrained N = {pretrained_steps}"
        )
    ax.set_xticks(depths)
    ax.set_xlabel("layers M of the discretised model")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def sweep(config, depths: list[int], methods: list[str]) -> dict:

    if not config.trainer.id:
        raise UserError("trainer.id is missing: the sweep names its runs <trainer.id>-<method>-M<depth>")
    preflight.check_run_id(config.trainer.id)
    out_dir = config.sweep.out_dir or os.path.join("sweeps", config.trainer.id)
    outputs.check_replaceable(out_dir, **_out_dir_rules(config))
    outputs.check_writable(out_dir, "sweep.out_dir", beside=True)
    rows, pretrained_steps, stopped_by = [], None, None
    grid = [(d, m) for m in methods for d in depths]
    for d, m in grid:  # check every cell before training any
        cell = cell_config(config, d, m)
        check_values(cell)
        preflight.check_outputs(cell)
        check_exports(cell)
    for i, (depth, method) in enumerate(grid, 1):
        cell = cell_config(config, depth, method)
        done = read_summary(cell.trainer, cell.trainer.id)
        if done is not None and done.get("finished") and done.get("steps", 0) >= cell.trainer.num_train_steps:
            print(f"[{i}/{len(grid)}] {cell.trainer.id}: finished before, skipped", flush=True)
            summary = done
        else:
            print(f"[{i}/{len(grid)}] {cell.trainer.id}: fine-tuning ({method}) at M = {depth}", flush=True)
            summary = finetune(cell)
            summary.pop("model", None)
            if not summary.get("finished"):
                print(
                    f"qkvflow sweep: {cell.trainer.id} did not finish; rerun the same command to resume",
                    file=sys.stderr,
                )
                rows.append(_row(summary, depth, method))
                stopped_by = summary.get("stopped_by")
                break
        pretrained_steps = summary.get("pretrained_steps_N", pretrained_steps)
        rows.append(_row(summary, depth, method))
        _write_outputs(rows, out_dir, config, pretrained_steps)  # after each cell: partial results survive a stop
    rows.sort(key=lambda r: (methods.index(r["method"]), r["M"]))
    paths = _write_outputs(rows, out_dir, config, pretrained_steps)
    return {
        "rows": rows,
        **paths,
        "stopped_by": stopped_by,
        "complete": len(rows) == len(grid) and all(r["eval_loss"] is not None for r in rows),
    }


def _out_dir_rules(config) -> dict:
    protect = [
        ("pretrained.checkpoint", config.pretrained.checkpoint),
        ("pretrained.config_path", config.pretrained.config_path),
        ("trainer.checkpointer.base_path", config.trainer.checkpointer.base_path),
    ]
    return {"kind": KIND, "key": "sweep.out_dir", "protect": protect}


def _write_outputs(rows, out_dir, config, pretrained_steps) -> dict:
    """Rewrite `out_dir` whole (swapped in when complete) with the table and the figure."""
    title = f"{config.trainer.id}: fine-tuning the discretised ODE model"
    with outputs.replacing(out_dir, **_out_dir_rules(config)) as folder:
        write_table(rows, folder, title)
        plot_sweep(rows, os.path.join(folder, "sweep.png"), pretrained_steps, title=config.trainer.id)
    return {name: os.path.join(out_dir, f"sweep.{name}") for name in ("csv", "md", "png")}
