"""Fine-tuning a pretrained DiffEqFormer at M layers (what `qkvflow finetune` runs; the command is in qkvflow.cli.finetune).

A DiffEqFormer trained with N ODE steps defines weights W(t) for every t in [0, 1]. Evaluating them
at M step times (dt = 1/M folded into the output projections) gives an ordinary parallel-block
transformer with M layers (`qkvflow.export.discretise`), for any M (the paper's Fig. 6: pretrain 18 steps,
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
import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import equinox as eqx
import haliax
import haliax.partitioning
import jax
import jax.random as jrandom
import levanter
import levanter.checkpoint
import levanter.tracker
from haliax import Axis
from levanter.adaptor.lora import LoraConfig, lora_trainable_params_filter, loraize, merge_lora_modules
from levanter.models.lm_model import LmConfig

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.plotting import plot_loss_curve
from qkvflow.training import faults, loop, preflight
from qkvflow.training.config import TrainConfig
from qkvflow.training.loss import lm_loss
from qkvflow.training.tracking import metrics_file

logger = logging.getLogger("qkvflow.finetune")

METHODS = ("lora", "full")
SOLVERS = ("euler",)
SUMMARY_FILE = "finetune_summary.json"


@dataclass(frozen=True)
class PretrainedSource:
    """The ODE run to start from: its `qkvflow train` config (only `model` is read) and checkpoint
    (a run folder, whose newest `step-N` is used, or a `step-N` folder)."""

    config_path: Optional[str] = None
    checkpoint: Optional[str] = None
    overrides: List[str] = field(default_factory=list)
    """`--dotted.key value` arguments applied to that config, as the pretraining run was started with
    them (e.g. ["--model.ode.num_steps", "18"]); only keys of `model` matter."""


@dataclass(frozen=True)
class ExportConfig:
    hf_dir: Optional[str] = None
    """Write a Hugging Face model to `<hf_dir>/<run_id>`: the fine-tuned model with LoRA merged in
    (`merged: true`) or the discretised base before fine-tuning (`merged: false`, what a PEFT adapter
    is applied to). `finetune: full` always writes the fine-tuned model (there is no adapter)."""
    peft_dir: Optional[str] = None
    """Write the LoRA adapter in PEFT format to `<peft_dir>/<run_id>` (`finetune: lora`; ignored for full)."""
    merged: bool = True


@dataclass(frozen=True)
class SweepSettings:
    """`qkvflow sweep`: the grid of depths x methods and where its table and figure go."""

    depths: List[int] = field(default_factory=lambda: [9, 12, 18, 24])
    methods: List[str] = field(default_factory=lambda: ["lora", "full"])
    out_dir: Optional[str] = None
    """Default: sweeps/<trainer.id>."""
    learning_rate: Dict[str, float] = field(default_factory=dict)
    """Per-method learning rates, e.g. {lora: 1e-3, full: 1e-4}; a method not listed uses optimizer.learning_rate."""


@dataclass
class FinetuneConfig(TrainConfig):
    model: Optional[LmConfig] = None
    """Not used: the model is the pretrained one, discretised (leave unset)."""
    pretrained: PretrainedSource = field(default_factory=PretrainedSource)
    steps: int = 12
    """M: the number of layers of the discretised model (any M >= 1, also unlike the N it was trained with)."""
    solver: str = "euler"
    finetune: str = "lora"
    """`lora` (only LoRA adapters train) or `full` (every parameter trains)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    lora_seed: int = 0
    """Seed of the adapters' initialisation (independent of trainer.seed, so a resume rebuilds them alike)."""
    eval_before: bool = True
    """Evaluate the discretised model once before fine-tuning (`initial_eval_loss`): how well the ODE
    model survives discretisation at M, and the baseline the fine-tuning improves on."""
    export: ExportConfig = field(default_factory=ExportConfig)
    sweep: SweepSettings = field(default_factory=SweepSettings)


# --- discretisation ----------------------------------------------------------------------------------


def discretise_model(model, steps: int, solver: str):
    """The ODE model as an M-layer parallel-block transformer (qkvflow.export.discretise)."""
    from qkvflow.export.discretise import discretise

    return discretise(model, steps, solver=solver)


# --- checks -------------------------------------------------------------------------------------------


def _is_ode_config(model_config) -> bool:
    from qkvflow.models import registry

    return registry.is_ode(model_config)


def check_values(config: FinetuneConfig) -> None:
    if config.model is not None:
        raise UserError(
            "model is invalid here: the model comes from pretrained.config_path (remove the `model` section)"
        )
    if isinstance(config.steps, bool) or not isinstance(config.steps, int) or config.steps < 1:
        raise UserError(f"steps={config.steps!r} is invalid: expected an integer >= 1 (the number of layers M)")
    if config.solver not in SOLVERS:
        raise UserError(f"solver={config.solver!r} is invalid: expected one of {', '.join(SOLVERS)}")
    if config.finetune not in METHODS:
        raise UserError(f"finetune={config.finetune!r} is invalid: expected one of {', '.join(METHODS)}")
    lora = config.lora
    if config.finetune == "lora":
        if isinstance(lora.r, bool) or not isinstance(lora.r, int) or lora.r < 1:
            raise UserError(f"lora.r={lora.r!r} is invalid: expected an integer >= 1")
        if not 0 <= lora.dropout < 1:
            raise UserError(f"lora.dropout={lora.dropout!r} is invalid: expected a float in [0, 1)")
    p = config.pretrained
    if not p.config_path:
        raise UserError("pretrained.config_path is missing: expected the `qkvflow train` config of the ODE run")
    if not os.path.isfile(p.config_path):
        raise UserError(f"pretrained.config_path={p.config_path!r}: file does not exist")
    if not p.checkpoint:
        raise UserError(
            "pretrained.checkpoint is missing: expected the ODE run's checkpoint folder (checkpoints/<run_id>)"
        )
    if levanter.checkpoint.discover_latest_checkpoint(p.checkpoint) is None:
        raise UserError(
            f"pretrained.checkpoint={p.checkpoint!r}: no checkpoint found (expected checkpoints/<run_id>[/step-N])"
        )


def load_pretrained_config(config: FinetuneConfig) -> TrainConfig:
    """The pretraining run's config; only its `model` is used. A DiffEqFormer is discretised at
    `steps`; any other model (a baseline) is fine-tuned as it is, at its own depth."""
    import draccus

    import qkvflow.models  # noqa: F401  (declares every model family, so parallel_* configs parse and are refused)
    from qkvflow.configfile import _user_cause, parse

    path = config.pretrained.config_path
    preflight.check_config_file(path)
    try:
        pretrained = parse(TrainConfig, ["--config_path", path, *config.pretrained.overrides], "train")
    except (draccus.utils.DecodingError, draccus.utils.ParsingError) as e:
        cause = _user_cause(e) or e.__cause__ or e
        raise UserError(f"pretrained.config_path={path!r}: {cause}") from None
    if not _is_ode_config(pretrained.model):
        layers = getattr(pretrained.model, "num_layers", None)
        if layers != config.steps:
            raise UserError(
                f"steps={config.steps} is invalid for pretrained.config_path={path!r}: its "
                f"{type(pretrained.model).__name__} has num_layers={layers} and a discrete model is fine-tuned at "
                f"its own depth (set steps: {layers}; only a DiffEqFormer is discretised at another M)"
            )
        if config.export.hf_dir is not None or config.export.peft_dir is not None:
            raise UserError(
                f"export is not supported for the {type(pretrained.model).__name__} of pretrained.config_path={path!r}: "
                "qkvflow exports discretised DiffEqFormers; remove export.hf_dir and export.peft_dir"
            )
    return pretrained


def pretrained_depth(model_config) -> int:
    """N: the ODE's number of solver steps, or a discrete model's number of layers."""
    return model_config.ode.num_steps if _is_ode_config(model_config) else model_config.num_layers


def check_pretrained_checkpoint(config: FinetuneConfig, pretrained: TrainConfig) -> None:
    """The checkpoint must hold the kind of model the config names: for a DiffEqFormer a generator of
    W(t), not e.g. a GPT-2 baseline's model, and for a baseline no generator; read from its array
    layout, before any device work (a baseline's remaining mismatches are named when it loads)."""
    from qkvflow.training.checkpoint_arrays import array_shapes

    latest = levanter.checkpoint.discover_latest_checkpoint(config.pretrained.checkpoint)
    arrays = [name.split("/") for name in array_shapes(str(latest)) if name.startswith("model/")]
    found = sorted({parts[1] for parts in arrays if len(parts) > 1})
    if not _is_ode_config(pretrained.model):
        if "generator" in found:
            raise UserError(
                f"pretrained.checkpoint={config.pretrained.checkpoint!r} holds a DiffEqFormer model but "
                f"pretrained.config_path={config.pretrained.config_path!r} describes a "
                f"{type(pretrained.model).__name__}: expected the config of the run that wrote the checkpoint"
            )
        return
    if "generator" not in found or _checkpoint_vocab(config.pretrained.checkpoint) is None:
        raise UserError(
            f"pretrained.checkpoint={config.pretrained.checkpoint!r} does not hold a DiffEqFormer model "
            f"(its model has {', '.join(found) or 'no arrays'}; expected generator, token_embeddings, ...): "
            f"expected a checkpoint of the ODE run of pretrained.config_path={config.pretrained.config_path!r}, "
            "not of a discrete baseline"
        )


def _checkpoint_vocab(checkpoint: str) -> Optional[int]:
    """The vocabulary size the ODE checkpoint was trained with (its token embedding's rows)."""
    from qkvflow.training.checkpoint_arrays import array_shapes

    latest = levanter.checkpoint.discover_latest_checkpoint(checkpoint)
    shape = array_shapes(str(latest)).get("model/token_embeddings/weight")
    return None if shape is None else int(shape[0])


def load_base(config: FinetuneConfig, pretrained: TrainConfig, tokenizer, Vocab: Axis, announce: bool = True):
    """The model to fine-tune: the ODE checkpoint discretised at `steps`, or a discrete baseline's
    checkpoint as it is. `announce`: say which step of the pretrained run was loaded (fine-tuning does;
    loading a fine-tuned run says only which of its own steps it loaded)."""
    from qkvflow.training.checkpoints import load_model

    stored = _checkpoint_vocab(config.pretrained.checkpoint)
    if stored is not None and stored < len(tokenizer):
        raise UserError(
            f"pretrained.checkpoint={config.pretrained.checkpoint!r} has a vocabulary of {stored} tokens but the "
            f"fine-tuning tokenizer has {len(tokenizer)}: fine-tune with the tokenizer of the pretraining run"
        )
    vocab = stored or Vocab.size
    # only the model section of the pretraining config matters; the data is this run's (its tokenizer)
    source = dataclasses.replace(pretrained, corpus=None, data=config.data)
    try:
        model, _ = load_model(source, config.pretrained.checkpoint, vocab_size=vocab, announce=announce)
    except UserError as e:
        raise UserError(f"pretrained.checkpoint: {e}") from None
    if not _is_ode_config(pretrained.model):
        return model
    return discretise_model(model, config.steps, config.solver)


def is_finetune_config(path: Optional[str]) -> bool:
    """Whether the YAML file at `path` is a `qkvflow finetune` config (it has a `pretrained:` section):
    how `qkvflow generate` and `qkvflow eval` tell a fine-tuning run from a training run. An unreadable
    file is not one (the config parser then names the problem)."""
    import yaml

    from qkvflow.configfile import _readable_config

    if path is None:
        return False
    try:
        with open(_readable_config(path)) as f:
            loaded = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and "pretrained" in loaded


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
        from qkvflow.training.tracking import read_metrics

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


def add_lora(model, lora: LoraConfig, seed: int = 0):
    """Levanter's `loraize`, such that the adapted model starts out computing exactly the discretised
    model: with `a_init_mode: zero` (Levanter's default) A = 0 and B is random; with `random`, B is
    set to 0 as in the LoRA paper and PEFT."""
    from levanter.adaptor.lora import LowRankLinear

    if lora.a_init_mode == "zero":
        return loraize(model, lora, key=jrandom.PRNGKey(seed))

    def zero_b(node):
        if isinstance(node, LowRankLinear):
            return eqx.tree_at(lambda n: n.lora_B.weight, node, node.lora_B.weight * 0)
        return node

    model = loraize(model, lora, key=jrandom.PRNGKey(seed))
    return jax.tree_util.tree_map(zero_b, model, is_leaf=lambda n: isinstance(n, LowRankLinear))


def frozen_base(model):
    """A filter that freezes everything except LoRA adapters, or None for full fine-tuning."""
    return lora_trainable_params_filter(model)


def finetune(config: FinetuneConfig) -> dict:
    """Fine-tune; return a summary (losses, parameter counts, outputs). `summary["model"]` is the
    final model in memory (with LoRA modules under `finetune: lora`)."""
    with contextlib.ExitStack() as cleanup:
        preemption = cleanup.enter_context(faults.Preemption(verb="qkvflow finetune"))
        return _finetune(config, preemption, cleanup)


def _finetune(config: FinetuneConfig, preemption: faults.Preemption, cleanup: contextlib.ExitStack) -> dict:
    from qkvflow.training import session

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
        if not any(isinstance(x, eqx.Module) and type(x).__name__ == "LoraLinear" for x in _modules(model)):
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
    what = f"the {depth}-step ODE model as" if _is_ode_config(pretrained.model) else f"the {type(base).__name__} of"
    print(f"fine-tuning ({config.finetune}) {what} {config.steps} layers", flush=True)
    loss_fn = functools.partial(lm_loss, z_loss_weight=config.z_loss_weight)
    summary, state = loop.train_run(run, loss_fn, tokenizer, preemption, tokens, inject)
    summary = {
        "method": config.finetune,
        "steps_M": config.steps,
        "pretrained_steps_N": depth,
        "pretrained_ode": _is_ode_config(pretrained.model),
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


def _modules(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: type(x).__name__ == "LoraLinear")


def merged_model(model, base, lora: LoraConfig, lora_seed: int = 0):
    """The fine-tuned model without LoRA modules: the trained adapters merged into the base.

    The trainer holds the frozen base in compute precision (Levanter casts non-trainable parameters);
    the merge uses `base`, the discretised model in its original precision."""
    if not any(type(x).__name__ == "LoraLinear" for x in _modules(model)):
        return model
    from levanter.adaptor.lora import is_lora_param, partition_lora_params

    base_params, _ = partition_lora_params(add_lora(base, lora, lora_seed))
    _, lora_params = partition_lora_params(model)
    return merge_lora_modules(eqx.combine(base_params, lora_params, is_leaf=is_lora_param))


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
    from qkvflow.export.hf_folder import save_hf_folder

    e = config.export
    # Levanter loads a MarinTokenizer; the transformers folder and the PEFT adapter are saved with the
    # Hugging Face tokenizer it wraps (as qkvflow.training.run_model.load_model hands to `qkvflow export`).
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

        from qkvflow.export.hf_folder import prompt_tokenizer

        path = os.path.join(e.peft_dir, run_id)
        base_path = os.path.abspath(os.path.join(e.hf_dir, run_id)) if (e.hf_dir and not e.merged) else None
        lora = dataclasses.replace(config.lora, target_modules=peft_target_modules(model))
        with outputs.replacing(path, kind=PEFT_KIND, key="export.peft_dir", protect=protect) as folder:
            save_peft_pretrained(model, lora, base_path, folder, prompt_tokenizer(tokenizer), prefix=PEFT_PREFIX)
        summary["peft_dir"] = path
        print(f"wrote the LoRA adapter (PEFT) to {path}", flush=True)
