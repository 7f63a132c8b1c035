"""The config of a `qkvflow finetune` run and its checks: what fine-tuning reads, and what loading a
fine-tuned run reads (`qkvflow.runs.model`), so that loading one does not go through the
fine-tuning run's module (`qkvflow.finetune.run`, whose docstring describes the method).

    FinetuneConfig                             `qkvflow train`'s keys, `pretrained:` instead of `model:`
    check_values(config)                       its values, before any work
    load_pretrained_config(config)             the pretraining run's config (its `model` is used)
    check_pretrained_checkpoint(config, ...)   the checkpoint holds the kind of model that config names
    is_finetune_config(path)                   a YAML file with a `pretrained:` section
"""

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import levanter.checkpoint
from levanter.adaptor.lora import LoraConfig
from levanter.models.lm_model import LmConfig

import qkvflow.models  # noqa: F401  (declares every model family, so parallel_* configs parse and are refused)
from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.runs.checkpoint_arrays import array_shapes
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.configfile import _readable_config, _user_cause, check_config_file, parse

METHODS = ("lora", "full")
SOLVERS = ("euler",)


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


def is_ode_config(model_config) -> bool:
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

    path = config.pretrained.config_path
    check_config_file(path)
    try:
        pretrained = parse(TrainConfig, ["--config_path", path, *config.pretrained.overrides], "train")
    except (draccus.utils.DecodingError, draccus.utils.ParsingError) as e:
        cause = _user_cause(e) or e.__cause__ or e
        raise UserError(f"pretrained.config_path={path!r}: {cause}") from None
    if not is_ode_config(pretrained.model):
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
    return model_config.ode.num_steps if is_ode_config(model_config) else model_config.num_layers


def check_pretrained_checkpoint(config: FinetuneConfig, pretrained: TrainConfig) -> None:
    """The checkpoint must hold the kind of model the config names: for a DiffEqFormer a generator of
    W(t), not e.g. a GPT-2 baseline's model, and for a baseline no generator; read from its array
    layout, before any device work (a baseline's remaining mismatches are named when it loads)."""
    latest = levanter.checkpoint.discover_latest_checkpoint(config.pretrained.checkpoint)
    arrays = [name.split("/") for name in array_shapes(str(latest)) if name.startswith("model/")]
    found = sorted({parts[1] for parts in arrays if len(parts) > 1})
    if not is_ode_config(pretrained.model):
        if "generator" in found:
            raise UserError(
                f"pretrained.checkpoint={config.pretrained.checkpoint!r} holds a DiffEqFormer model but "
                f"pretrained.config_path={config.pretrained.config_path!r} describes a "
                f"{type(pretrained.model).__name__}: expected the config of the run that wrote the checkpoint"
            )
        return
    if "generator" not in found or checkpoint_vocab(config.pretrained.checkpoint) is None:
        raise UserError(
            f"pretrained.checkpoint={config.pretrained.checkpoint!r} does not hold a DiffEqFormer model "
            f"(its model has {', '.join(found) or 'no arrays'}; expected generator, token_embeddings, ...): "
            f"expected a checkpoint of the ODE run of pretrained.config_path={config.pretrained.config_path!r}, "
            "not of a discrete baseline"
        )


def checkpoint_vocab(checkpoint: str) -> Optional[int]:
    """The vocabulary size the ODE checkpoint was trained with (its token embedding's rows)."""
    latest = levanter.checkpoint.discover_latest_checkpoint(checkpoint)
    shape = array_shapes(str(latest)).get("model/token_embeddings/weight")
    return None if shape is None else int(shape[0])


def is_finetune_config(path: Optional[str]) -> bool:
    """Whether the YAML file at `path` is a `qkvflow finetune` config (it has a `pretrained:` section):
    how `qkvflow generate` and `qkvflow eval` tell a fine-tuning run from a training run. An unreadable
    file is not one (the config parser then names the problem)."""
    import yaml

    if path is None:
        return False
    try:
        with open(_readable_config(path)) as f:
            loaded = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and "pretrained" in loaded
