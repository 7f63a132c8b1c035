"""Fine-tuning a pretrained DiffEqFormer at M layers (what `qkvflow finetune` runs; the command is in qkvflow.cli.finetune).

A DiffEqFormer trained with N ODE steps defines weights W(t) for every t in [0, 1]. Evaluating them
at M step times (dt = 1/M folded into the output projections) gives an ordinary parallel-block
transformer with M layers (`qkvflow.models.discretise`), for any M (the paper's Fig. 6: pretrain 18 steps,
fine-tune at 9, 12, 18, 24 layers). This verb loads the ODE checkpoint, discretises it at
`steps: M`, and trains the result with Levanter's trainer on the configured data:

* `finetune: full`: every parameter of the discretised model is trained;
* `finetune: lora`: Levanter's LoRA (`lora:` section, `levanter.adaptor.lora.LoraConfig`) wraps the
  matching linear projections; only the adapters are trainable, the base stays bit-identical
  (and is not written into the checkpoints: it is rebuilt from the ODE checkpoint on resume).

A discrete model (a GPT-2 or Llama baseline of `qkvflow train`) is fine-tuned the same way at its own
depth (`steps` must equal its `num_layers`), so that a baseline meets the DiffEqFormer under the same
fine-tuning (the paper's Fig. 6 compares with GPT pretrained and fine-tuned at the larger depth).

Data, trainer, optimizer, epochs, stop_after, nonfinite, ... are `qkvflow train`'s keys (this
config extends `TrainConfig`); the model comes from `pretrained` instead of `model`. Checkpoints
and resuming are `qkvflow train`'s: run the same command with the same `trainer.id`.

At the end, `export:` optionally writes the model in Hugging Face format (`hf_dir`: the merged
model, or with `merged: false` the un-fine-tuned discretised base) and the adapter in PEFT format
(`peft_dir`, LoRA only), each into `<dir>/<run_id>`; and `finetune_summary.json` beside the
checkpoints, which `qkvflow sweep` reads. The exports replace only earlier exports of qkvflow
(`qkvflow.outputs`: written into a temporary sibling and swapped in; a folder without qkvflow's marker,
or holding the pretrained checkpoint, its config or this run's checkpoints, is refused before training).
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
from typing import Optional

import equinox as eqx
import haliax
import jax
import levanter
import levanter.tracker

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.export.hf_folder import prompt_tokenizer, save_hf_folder
from qkvflow.plotting import plot_loss_curve
from qkvflow.runs.finetune_config import (  # the config and its checks; also what `qkvflow sweep` imports here
    METHODS,
    SOLVERS,
    ExportConfig,
    FinetuneConfig,
    PretrainedSource,
    SweepSettings,
    check_pretrained_checkpoint,
    check_values,
    is_finetune_config,
    is_ode_config,
    load_pretrained_config,
    pretrained_depth,
)
from qkvflow.runs.model import add_lora, frozen_base, load_base, lora_modules, merged_model
from qkvflow.runs.tracking import metrics_file, read_metrics
from qkvflow.training import faults, loop, preflight, session
from qkvflow.training.loss import train_loss

__all__ = [
    "METHODS",
    "SOLVERS",
    "ExportConfig",
    "FinetuneConfig",
    "PretrainedSource",
    "SweepSettings",
    "check_exports",
    "check_pretrained_checkpoint",
    "check_values",
    "finetune",
    "is_finetune_config",
    "load_pretrained_config",
    "read_summary",
]

logger = logging.getLogger("qkvflow.finetune")

SUMMARY_FILE = "finetune_summary.json"


# --- the run ------------------------------------------------------------------------------------------


def _summary_path(trainer_config, run_id: str) -> str:
    return os.path.join(trainer_config.checkpointer.expanded_path(run_id), SUMMARY_FILE)


def read_summary(trainer_config, run_id: str) -> Optional[dict]:
    import fsspec

    path = _summary_path(trainer_config, run_id)
    try:
        with fsspec.open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


CARRIED = ("initial_eval_loss", "initial_eval_perplexity", "train_loss", "train_perplexity")
"""What a resumed run cannot measure again and takes from the summary of the run it resumes: the
validation loss before fine-tuning (measured at step 0 only), and the last train loss when it trains
no step."""


def _carry_over(summary: dict, previous: dict, jsonl) -> None:
    for key in CARRIED:
        if key not in summary and key in previous:
            summary[key] = previous[key]
    if "train_loss" not in summary and jsonl is not None:  # no summary written before (e.g. a crash): the metrics
        steps = read_metrics(metrics_file(jsonl.path, summary["run_id"]))
        losses = [steps[s]["train/loss"] for s in sorted(steps) if "train/loss" in steps[s]]
        if losses:
            summary.update(train_loss=losses[-1], train_perplexity=math.exp(min(losses[-1], 80.0)))


def _write_summary(trainer_config, run_id: str, summary: dict) -> None:
    import fsspec

    keep = (int, float, str, bool, type(None), list)
    record = {k: v for k, v in summary.items() if isinstance(v, keep)}
    with fsspec.open(_summary_path(trainer_config, run_id), "w") as f:
        json.dump(record, f, indent=1)


def finetune(config: FinetuneConfig) -> dict:
    """Fine-tune; return a summary (losses, parameter counts, outputs). `summary["model"]` is the
    final model in memory (with LoRA modules under `finetune: lora`)."""
    with contextlib.ExitStack() as cleanup:
        preemption = cleanup.enter_context(faults.Preemption(verb="qkvflow finetune"))
        return _finetune(config, preemption, cleanup)


def _finetune(config: FinetuneConfig, preemption: faults.Preemption, cleanup: contextlib.ExitStack) -> dict:
    preflight.check_outputs(config)  # the write probes first: before any work
    check_exports(config)
    check_values(config)
    pretrained = load_pretrained_config(config)
    check_pretrained_checkpoint(config, pretrained)

    def prepare(config, tokenizer, Vocab):  # before the run writes anything (session.start)
        base = load_base(config, pretrained, tokenizer, Vocab)
        if config.finetune != "lora":
            return (base, base, True), base.config.max_Pos
        model = haliax.named_jit(lambda m: add_lora(m, config.lora, config.lora_seed))(base)
        if not any(isinstance(x, eqx.Module) and type(x).__name__ == "LoraLinear" for x in lora_modules(model)):
            raise UserError(
                f"lora.target_modules={config.lora.target_modules!r} matches no linear projection of the "
                "model to fine-tune"
            )
        return (base, model, frozen_base(model)), base.config.max_Pos

    config, tokenizer, inject, Vocab, tokens, (base, model, is_trainable) = session.start(config, cleanup, prepare)
    t = config.trainer
    model_config = base.config
    Pos = model_config.max_Pos
    flops = model_config.flops_per_token(len(tokenizer), Pos.size) if hasattr(model_config, "flops_per_token") else None
    run = loop.Run(
        config,
        "qkvflow finetune",
        Pos,
        model=model,
        is_trainable=is_trainable,
        flops_per_token=flops,
        eval_before=config.eval_before,
    )
    del model
    depth = pretrained_depth(pretrained.model)
    what = f"the {depth}-step ODE model as" if is_ode_config(pretrained.model) else f"the {type(base).__name__} of"
    print(f"fine-tuning ({config.finetune}) {what} {config.steps} layers", flush=True)
    loss_fn = train_loss(config)  # train's loss, with its z-loss and vocabulary block
    summary, state = loop.train_run(run, loss_fn, tokenizer, preemption, tokens, inject)
    summary = {
        "method": config.finetune,
        "steps_M": config.steps,
        "pretrained_steps_N": depth,
        "pretrained_ode": is_ode_config(pretrained.model),
        **summary,
    }
    summary.setdefault("trainable_parameter_count", summary.get("parameter_count"))
    if "run_id" not in summary:  # stopped before the trainer started
        return summary
    run_id = summary["run_id"]
    if summary.get("nothing_to_train"):
        previous = read_summary(t, run_id) or {}
        summary.update({k: v for k, v in previous.items() if k not in summary})
    summary["finished"] = finished = not summary.get("preempted") and summary["steps"] >= t.num_train_steps
    if summary["steps"] > 0:
        _carry_over(summary, read_summary(t, run_id) or {}, loop.jsonl_tracker(t))
    if state is not None and summary["steps"] > 0:
        summary["model"] = state.model
        if finished and jax.process_index() == 0:
            export(config, state.model, base, tokenizer, run_id, summary)

    jsonl = loop.jsonl_tracker(t)
    if jsonl is not None and jax.process_index() == 0:
        summary["metrics"] = metrics_file(jsonl.path, run_id)
        if config.loss_curve and os.path.exists(summary["metrics"]):
            out = os.path.join(os.path.dirname(summary["metrics"]), config.loss_curve)
            title = f"{config.finetune} fine-tuning at M={config.steps} (N={depth})"
            summary["loss_curve"] = plot_loss_curve(summary["metrics"], out, title=title)
    if jax.process_index() == 0:
        _write_summary(t, run_id, summary)
    levanter.tracker.current_tracker().finish()
    return summary


def peft_target_modules(model) -> list[str]:
    """The names of the projections that carry LoRA (e.g. q_proj, up_proj, lm_head): what PEFT's
    `target_modules` needs to put the adapters on the same torch modules (Levanter's own regexes
    match its paths, which differ from the torch ones by the layer stacking)."""
    from levanter.adaptor.lora import LoraLinear
    from levanter.utils.jax_utils import leaf_key_paths

    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731
    paths = jax.tree_util.tree_leaves(leaf_key_paths(model, is_leaf=is_lora), is_leaf=lambda x: isinstance(x, str))
    leaves = jax.tree_util.tree_leaves(model, is_leaf=is_lora)
    names = {path.split(".")[-1] for path, leaf in zip(paths, leaves) if is_lora(leaf)}
    return sorted(names)


PEFT_PREFIX = "base_model.model"
"""Where the torch model's state dict sits inside a PEFT model (see qkvflow.models.discrete.model)."""


HF_KIND, PEFT_KIND = "hf_export", "peft_adapter"


def _export_targets(config: FinetuneConfig, run_id: str) -> list[tuple[str, str, str]]:
    """(config key, folder, kind) of each export this run writes."""
    e, targets = config.export, []
    if e.hf_dir is not None:
        targets.append(("export.hf_dir", os.path.join(e.hf_dir, run_id), HF_KIND))
    if e.peft_dir is not None and config.finetune == "lora":
        targets.append(("export.peft_dir", os.path.join(e.peft_dir, run_id), PEFT_KIND))
    return targets


def _protected(config: FinetuneConfig, run_id: str) -> list[tuple[str, str]]:
    p, t = config.pretrained, config.trainer
    return [
        ("pretrained.checkpoint", p.checkpoint),
        ("pretrained.config_path", p.config_path),
        ("the run's checkpoints", t.checkpointer.expanded_path(run_id)),
    ]


def check_exports(config: FinetuneConfig) -> None:
    """Before training: each export folder can be written and, if it exists, is an earlier export of
    qkvflow (`qkvflow.outputs.check_replaceable`), so that hours of fine-tuning never end in a refusal."""
    e = config.export
    run_id = config.trainer.id
    if run_id is None:  # Levanter picks one at start-up: only the parent folders are known
        for key, folder in (("export.hf_dir", e.hf_dir), ("export.peft_dir", e.peft_dir)):
            outputs.check_writable(folder, key)
        return
    for key, folder, kind in _export_targets(config, run_id):
        outputs.check_replaceable(folder, kind=kind, key=key, protect=_protected(config, run_id))
        outputs.check_writable(folder, key, beside=True)


def export(config: FinetuneConfig, model, base, tokenizer, run_id: str, summary: dict) -> None:
    e = config.export
    # Levanter loads a MarinTokenizer; the transformers folder and the PEFT adapter are saved with the
    # Hugging Face tokenizer it wraps (as qkvflow.runs.model.load_model hands to `qkvflow export`).
    if hasattr(tokenizer, "as_hf_tokenizer"):
        tokenizer = tokenizer.as_hf_tokenizer()
    ode_steps = summary.get("pretrained_steps_N")
    protect = _protected(config, run_id)
    if e.hf_dir is not None:
        path = os.path.join(e.hf_dir, run_id)
        # full fine-tuning has no base/adapter split: `merged` does not apply, the fine-tuned model is
        # written (and `base` may hold buffers the trainer donated to the train step)
        lora = config.finetune == "lora"
        out = base if lora and not e.merged else merged_model(model, base, config.lora, config.lora_seed)
        with outputs.replacing(path, kind=HF_KIND, key="export.hf_dir", protect=protect) as folder:
            save_hf_folder(out, folder, tokenizer=tokenizer, ode_steps=ode_steps)
        summary["hf_dir"] = path
        what = (
            "the discretised base model"
            if lora and not e.merged
            else "the fine-tuned model" + (" (merged)" if lora else "")
        )
        print(f"wrote {what} (Hugging Face format) to {path}", flush=True)
    if e.peft_dir is not None and config.finetune != "lora":
        print(
            "export.peft_dir: no adapter to write (finetune: full); the fine-tuned model is in export.hf_dir",
            flush=True,
        )
    elif e.peft_dir is not None:
        from levanter.adaptor.lora import save_peft_pretrained

        path = os.path.join(e.peft_dir, run_id)
        base_path = os.path.abspath(os.path.join(e.hf_dir, run_id)) if (e.hf_dir and not e.merged) else None
        lora = dataclasses.replace(config.lora, target_modules=peft_target_modules(model))
        with outputs.replacing(path, kind=PEFT_KIND, key="export.peft_dir", protect=protect) as folder:
            save_peft_pretrained(model, lora, base_path, folder, prompt_tokenizer(tokenizer), prefix=PEFT_PREFIX)
        summary["peft_dir"] = path
        print(f"wrote the LoRA adapter (PEFT) to {path}", flush=True)
