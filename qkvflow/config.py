"""The configuration of a training run, parsed by draccus from YAML plus `--dotted.key value` overrides.

The sections are Levanter's own (data, trainer, optimizer) and a `model` chosen by `type`:
qkvflow's ODE models (see qkvflow.models.config), their discretised parallel-block transformers
(`parallel_gpt2` / `parallel_llama`, qkvflow.models.discrete) or Levanter's `gpt2` / `llama`.
`corpus` optionally builds one of qkvflow's offline corpora and points `data` at it.
"""

from dataclasses import dataclass, field
from typing import Optional, Union

from levanter.data.text import HfSingleDatasetLMConfig, LMMixtureDatasetConfig, UrlSingleDatasetLMConfig
from levanter.models.lm_model import LmConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.trainer import TrainerConfig

import qkvflow.models.config  # noqa: F401  (registers the model types with Levanter)
import qkvflow.models.discrete  # noqa: F401  (registers parallel_gpt2 / parallel_llama: discretised models)
import qkvflow.tracking  # noqa: F401  (registers the jsonl tracker, so that any verb parses `type: jsonl`)
from qkvflow.data.heldout import HeldOutHfSingleDatasetLMConfig
from qkvflow.models.config import DiffEqFormerGpt2Config


@dataclass(frozen=True)
class CorpusConfig:
    """A corpus qkvflow builds locally, with its tokenizer: `pydoc` (ships with Python) or
    `tinyshakespeare` (read from ../shared). Files go to `root/<name>/`."""

    name: str = "pydoc"
    root: str = "cache/corpora"
    vocab_size: Optional[int] = None


@dataclass
class TrainConfig:
    # draccus decodes a Union with its first member that accepts the YAML: `id:` selects the held-out
    # HF config (a superset of Levanter's HfSingleDatasetLMConfig, so it must come before it);
    # `train_urls:` / `validation_urls:` fail on it (`id` is required) and select the URL config.
    data: Union[
        HeldOutHfSingleDatasetLMConfig, UrlSingleDatasetLMConfig, HfSingleDatasetLMConfig, LMMixtureDatasetConfig
    ] = field(default_factory=UrlSingleDatasetLMConfig)
    corpus: Optional[CorpusConfig] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: LmConfig = field(default_factory=DiffEqFormerGpt2Config)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    epochs: int = 0
    """Passes over the training data: 0 reads it once (the run ends early if it runs out);
    N > 0 loops it N times (reshuffled by Levanter each pass)."""
    stop_after: Optional[int] = None
    """Stop this invocation once the run reaches this step and save a checkpoint; the schedule still
    spans trainer.num_train_steps, so running again with the same trainer.id continues exactly.
    For jobs in limited time slots."""
    log_every: int = 10
    """Print a progress line (step, loss, perplexity, tokens/s) every this many steps."""
    z_loss_weight: float = 0.0
    nonfinite: str = "stop"
    """A step whose loss or gradients are not finite: `stop` ends the run (exit status 3, naming the
    step and where the values first appeared; nothing is saved for that step), `skip` leaves the model
    and optimizer state unchanged and goes on."""
    data_seed: Optional[int] = None
    loss_curve: Optional[str] = "loss_curve.png"
    """File name of the loss-curve PNG, written beside the jsonl tracker's metrics.jsonl
    (runs/<run_id>/ by default) at the end of training; null to skip."""
