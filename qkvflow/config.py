"""The configuration of a training run, parsed by draccus from YAML plus `--dotted.key value` overrides.

The sections are Levanter's own (data, trainer, optimizer) and a `model` chosen by `type`:
qkvflow's ODE models (see qkvflow.models.config) or Levanter's discrete `gpt2` / `llama`.
`corpus` optionally builds one of qkvflow's offline corpora and points `data` at it.
"""

from dataclasses import dataclass, field
from typing import Optional, Union

from levanter.data.text import LMMixtureDatasetConfig, SingleDatasetLMConfig, UrlSingleDatasetLMConfig
from levanter.models.lm_model import LmConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.trainer import TrainerConfig

import qkvflow.models.config  # noqa: F401  (registers the model types with Levanter)
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
    data: Union[SingleDatasetLMConfig, LMMixtureDatasetConfig] = field(default_factory=UrlSingleDatasetLMConfig)
    corpus: Optional[CorpusConfig] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: LmConfig = field(default_factory=DiffEqFormerGpt2Config)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    z_loss_weight: float = 0.0
    data_seed: Optional[int] = None
    loss_curve: Optional[str] = "loss_curve.png"
    """File name of the loss-curve PNG, written beside the jsonl tracker's metrics.jsonl
    (runs/<run_id>/ by default) at the end of training; null to skip."""
