"""Loading a trained run's model: what `qkvflow eval`, `generate` and `export` (and `analyze`, the
benchmarks, and fine-tuning's pretrained run) read back from a checkpoint.

    newest_step(checkpoint)              the step-N folder a --checkpoint argument stands for
    load_model(config, checkpoint)       a `qkvflow train` run (a DiffEqFormer or a baseline): (model, tokenizer)
                                         (these two live in qkvflow.training.checkpoints, beneath
                                         fine-tuning, which loads its pretrained run with them)
    load_finetuned(config, checkpoint)   a `qkvflow finetune` run: the discretised base, its fine-tuned
                                         parameters restored, LoRA merged
    load_run_model(config, checkpoint)   either, by the config's type (a FinetuneConfig has `pretrained:`)

A checkpoint argument is a `step-N` folder or a run folder, whose newest complete step is loaded. A run
folder with a step whose `metadata.json` exists but cannot be read is refused in one line, as `qkvflow
train` refuses to resume from it (`qkvflow.training.faults`), rather than passed over for an older step.
The loaders print the folder they loaded on stderr (stdout stays the verb's own output).
"""

import equinox as eqx
import jax
import levanter.checkpoint
import numpy as np
from haliax import Axis

from qkvflow.errors import UserError
from qkvflow.training.checkpoints import load_model, loaded, missing_arrays, name_some, newest_step, restore_error

__all__ = ["load_finetuned", "load_model", "load_run_model", "newest_step"]


def load_finetuned(config, checkpoint: str):
    """(model, Hugging Face tokenizer) of a `qkvflow finetune` checkpoint of `config`'s run (a
    FinetuneConfig): the discretised base (`finetune.load_base`), LoRA added as fine-tuning added it, the
    checkpoint's trainable parameters restored into that shape, the adapters merged (`merged_model`).
    With `finetune: full` every parameter comes from the checkpoint. The model is a `steps`-layer
    parallel transformer."""
    from levanter.trainer_state import make_floating_point_trainable_filter

    from qkvflow.training import data_checks, finetune
    from qkvflow.training.session import with_corpus

    finetune.check_values(config)
    pretrained = finetune.load_pretrained_config(config)
    finetune.check_pretrained_checkpoint(config, pretrained)
    config = with_corpus(config)
    tokenizer = data_checks.load_tokenizer(config.data)
    if hasattr(tokenizer, "as_hf_tokenizer"):
        tokenizer = tokenizer.as_hf_tokenizer()
    base = finetune.load_base(config, pretrained, tokenizer, Axis("vocab", len(tokenizer)), announce=False)
    model, is_trainable = base, True
    if config.finetune == "lora":
        model = finetune.add_lora(base, config.lora, config.lora_seed)
        is_trainable = finetune.frozen_base(model)
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
    return finetune.merged_model(model, base, config.lora, config.lora_seed), tokenizer


def load_run_model(config, checkpoint: str):
    """(model, Hugging Face tokenizer) of a checkpoint of `qkvflow train` (`config` a TrainConfig:
    `load_model`) or of `qkvflow finetune` (a FinetuneConfig: `load_finetuned`). What `qkvflow generate`
    and `qkvflow eval` decode and score."""
    from qkvflow.training.finetune import FinetuneConfig

    if isinstance(config, FinetuneConfig):
        return load_finetuned(config, checkpoint)
    return load_model(config, checkpoint)
