"""`qkvflow finetune`: turn a pretrained DiffEqFormer into an M-layer transformer and fine-tune it.

The work (discretising, LoRA, the run, exports) is in `qkvflow.finetune.run`, whose docstring
describes the config; this module is the command: parse, run, print the summary, exit status.
"""

import sys

from qkvflow.cli.startup import usage
from qkvflow.cli.train import NONFINITE_EXIT, headline, stop_status
from qkvflow.finetune.run import FinetuneConfig, finetune
from qkvflow.runs import configfile
from qkvflow.training import faults


def print_summary(summary: dict, config: FinetuneConfig) -> None:
    print(f"\n== qkvflow finetune: {headline(summary, config)} ==")
    keys = (
        "run_id",
        "method",
        "steps_M",
        "pretrained_steps_N",
        "trainable_parameter_count",
        "parameter_count",
        "steps",
        "skipped_steps",
        "initial_eval_loss",
        "initial_eval_perplexity",
        "train_loss",
        "train_perplexity",
        "eval_loss",
        "eval_perplexity",
    )
    for key in keys:
        if key in summary:
            value = summary[key]
            print(f"{key:>25}: {value:.4f}" if isinstance(value, float) else f"{key:>25}: {value}")
    for key in ("checkpoints", "metrics", "loss_curve", "hf_dir", "peft_dir"):
        if key in summary:
            print(f"{key:>25}: {summary[key]}")


def _run(config: FinetuneConfig) -> dict:
    summary = finetune(config)
    print_summary(summary, config)
    return summary


def main(argv: list[str]) -> int:
    if usage.wants_help(argv):
        summary = "Discretise a pretrained ODE model at `steps: M` layers and fine-tune it (LoRA or full)."
        print(usage.short_help("qkvflow finetune", FinetuneConfig, summary, hide=("model",)))
        return 0
    try:
        summary = _run(configfile.parse(FinetuneConfig, usage.full_listing_args(argv), "finetune"))
    except faults.NonFiniteError as e:
        print(f"qkvflow finetune: error: {e}. Lower the learning rate, or set `nonfinite: skip`.", file=sys.stderr)
        return NONFINITE_EXIT
    return stop_status(summary)
