"""Loading a trained run's model: what `qkvflow eval`, `generate` and `export` (and `analyze`, the
benchmarks, and fine-tuning's pretrained run) read back from a checkpoint.

    newest_step(checkpoint)              the step-N folder a --checkpoint argument stands for
    load_model(config, checkpoint)       a `qkvflow train` run (a DiffEqFormer or a baseline): (model, tokenizer)
                                         (these two live in qkvflow.runs.checkpoints, beneath
                                         fine-tuning, which loads its pretrained run with them)
    load_finetuned(config, checkpoint)   a `qkvflow finetune` run: the discretised base, its fine-tuned
                                         parameters restored, LoRA merged
    load_run_model(config, checkpoint)   either, by the config's type (a FinetuneConfig has `pretrained:`)

and the shape of a fine-tuned run, which fine-tuning builds with the same functions (it imports them
from here, so that no verb's load goes through `qkvflow.finetune.run`):

    load_base(config, pretrained, ...)   the pretrained run's model, discretised at `steps` (`discretise_model`)
    add_lora(model, lora, seed)          Levanter's LoRA on it, starting out as the discretised model
    merged_model(model, base, lora)      the trained adapters merged back into the base

A checkpoint argument is a `step-N` folder or a run folder, whose newest complete step is loaded. A run
folder with a step whose `metadata.json` exists but cannot be read is refused in one line, as `qkvflow
train` refuses to resume from it (`qkvflow.training.faults`), rather than passed over for an older step.
The loaders print the folder they loaded on stderr (stdout stays the verb's own output).
"""

import dataclasses

import equinox as eqx
import jax
import jax.random as jrandom
import levanter.checkpoint
import numpy as np
from haliax import Axis
from levanter.adaptor.lora import LoraConfig, lora_trainable_params_filter, loraize, merge_lora_modules

from qkvflow.errors import UserError
from qkvflow.models.discretise import discretise
from qkvflow.runs import data_checks, finetune_config
from qkvflow.runs.checkpoints import load_model, loaded, missing_arrays, name_some, newest_step, restore_error
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.corpus import with_corpus
from qkvflow.runs.finetune_config import FinetuneConfig, checkpoint_vocab, is_ode_config

__all__ = [
    "add_lora",
    "discretise_model",
    "frozen_base",
    "load_base",
    "load_finetuned",
    "load_model",
    "load_run_model",
    "merged_model",
    "newest_step",
    "run_folder",
]


# --- the base model, discretised, and LoRA (what fine-tuning trains; a fine-tuned run's shape) -----------


def discretise_model(model, steps: int, solver: str):
    """The ODE model as an M-layer parallel-block transformer (qkvflow.models.discretise)."""
    return discretise(model, steps, solver=solver)


def load_base(config: FinetuneConfig, pretrained: TrainConfig, tokenizer, Vocab: Axis, announce: bool = True):
    """The model to fine-tune: the ODE checkpoint discretised at `steps`, or a discrete baseline's
    checkpoint as it is. `announce`: say which step of the pretrained run was loaded (fine-tuning does;
    loading a fine-tuned run says only which of its own steps it loaded)."""
    stored = checkpoint_vocab(config.pretrained.checkpoint)
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
    if not is_ode_config(pretrained.model):
        return model
    return discretise_model(model, config.steps, config.solver)


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


def lora_modules(tree):
    """The leaves of `tree`, with each LoRA-wrapped linear projection (`LoraLinear`) as one leaf."""
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: type(x).__name__ == "LoraLinear")


def merged_model(model, base, lora: LoraConfig, lora_seed: int = 0):
    """The fine-tuned model without LoRA modules: the trained adapters merged into the base.

    The trainer holds the frozen base in compute precision (Levanter casts non-trainable parameters);
    the merge uses `base`, the discretised model in its original precision."""
    if not any(type(x).__name__ == "LoraLinear" for x in lora_modules(model)):
        return model
    from levanter.adaptor.lora import is_lora_param, partition_lora_params

    base_params, _ = partition_lora_params(add_lora(base, lora, lora_seed))
    _, lora_params = partition_lora_params(model)
    return merge_lora_modules(eqx.combine(base_params, lora_params, is_leaf=is_lora_param))


def run_folder(checkpoint: str) -> str:
    """The run folder of a checkpoint argument: the parent of a step folder (one that holds Levanter's
    `metadata.json`, as `newest_step` tells them apart), else the argument itself (checkpoints/<run_id>).
    What the verbs write nothing into: its step-N folders are the run's (`qkvflow.outputs.check_outside`)."""
    import os

    checkpoint = str(checkpoint)
    if "://" in checkpoint:
        return checkpoint
    folder = os.path.normpath(os.path.expanduser(checkpoint))
    return os.path.dirname(folder) if os.path.isfile(os.path.join(folder, "metadata.json")) else folder


# --- a run's model ---------------------------------------------------------------------------------------


def load_finetuned(config, checkpoint: str):
    """(model, Hugging Face tokenizer) of a `qkvflow finetune` checkpoint of `config`'s run (a
    FinetuneConfig): the discretised base (`load_base`), LoRA added as fine-tuning added it, the
    checkpoint's trainable parameters restored into that shape, the adapters merged (`merged_model`).
    With `finetune: full` every parameter comes from the checkpoint. The model is a `steps`-layer
    parallel transformer."""
    from levanter.trainer_state import make_floating_point_trainable_filter

    finetune_config.check_values(config)
    pretrained = finetune_config.load_pretrained_config(config)
    finetune_config.check_pretrained_checkpoint(config, pretrained)
    config = with_corpus(config)
    tokenizer = data_checks.load_tokenizer(config.data)
    if hasattr(tokenizer, "as_hf_tokenizer"):
        tokenizer = tokenizer.as_hf_tokenizer()
    base = load_base(config, pretrained, tokenizer, Axis("vocab", len(tokenizer)), announce=False)
    model, is_trainable = base, True
    if config.finetune == "lora":
        model = add_lora(base, config.lora, config.lora_seed)
        is_trainable = frozen_base(model)
    # the trainer saves only the trainable parameters (Levanter's `saveable_training_mask`): restore
    # those, keep the rest (the discretised base) from the pretrained checkpoint
    trainable, frozen = eqx.partition(model, make_floating_point_trainable_filter(is_trainable))
    path = newest_step(checkpoint)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    try:
        with jax.set_mesh(mesh):
            shape = eqx.filter_eval_shape(lambda: trainable)
            trainable = levanter.checkpoint.load_checkpoint(shape, path, subpath="model", mesh=mesh)
    except (KeyError, ValueError, FileNotFoundError) as e:
        what = f"checkpoint {path!r} does not hold the model that {config.finetune} fine-tuning of this config trains"
        absent = missing_arrays(path, e)
        if absent:  # e.g. the checkpoint of a full run for a LoRA config: name the arrays, not resume options
            raise UserError(
                f"{what}: it lacks {len(absent)} of its arrays ({name_some(absent)}); expected a checkpoint of this config's run"
            ) from None
        raise restore_error(path, e, advice="use an earlier step-N folder of the run") or UserError(
            f"{what} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    model = eqx.combine(trainable, frozen)
    loaded(path)
    return merged_model(model, base, config.lora, config.lora_seed), tokenizer


def load_run_model(config, checkpoint: str):
    """(model, Hugging Face tokenizer) of a checkpoint of `qkvflow train` (`config` a TrainConfig:
    `load_model`) or of `qkvflow finetune` (a FinetuneConfig: `load_finetuned`). What `qkvflow generate`
    and `qkvflow eval` decode and score."""
    if isinstance(config, FinetuneConfig):
        return load_finetuned(config, checkpoint)
    return load_model(config, checkpoint)
