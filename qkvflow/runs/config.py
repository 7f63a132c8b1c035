"""The configuration of a training run, parsed by draccus from YAML plus `--dotted.key value` overrides.

The sections are Levanter's own (data, trainer, optimizer) and a `model` chosen by `type`:
qkvflow's ODE models (see qkvflow.models.diffeqformer), their discretised parallel-block transformers
(`parallel_gpt2` / `parallel_llama`, qkvflow.models.discrete) or Levanter's `gpt2` / `llama`.
`corpus` optionally builds one of qkvflow's offline corpora and points `data` at it.
"""

from dataclasses import dataclass, field
from typing import Optional

from levanter.data.text import LmDataConfig
from levanter.models.lm_model import LmConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.trainer import TrainerConfig

import qkvflow.data.heldout  # noqa: F401  (registers the `hf_heldout` data source)
import qkvflow.models  # noqa: F401  (declares every model family: registers its type with Levanter)
import qkvflow.runs.tracking  # noqa: F401  (registers the jsonl tracker, so that any verb parses `type: jsonl`)
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config


@dataclass(frozen=True)
class CorpusConfig:
    """A corpus qkvflow builds locally, with its tokenizer: `pydoc` (ships with Python) or
    `tinyshakespeare` (read from ../shared). Files go to `root/<name>/`."""

    name: str = "pydoc"
    root: str = "cache/corpora"
    vocab_size: Optional[int] = None
    eval_split: str = "validation"
    """Held-out documents the run evaluates on: `validation` (all), or one of its two disjoint halves,
    `selection` (to choose hyperparameters on) and `test` (to report on): qkvflow.data.corpora."""


@dataclass
class TrainConfig:
    data: LmDataConfig = field(default_factory=LmDataConfig)
    """Levanter's data config: `tokenizer`, `cache_dir` and `components` (each a `source` of type `url`
    (train_urls, validation_urls), `hf` (a Hugging Face dataset) or `hf_heldout` (qkvflow.data.heldout:
    a validation split held out of a train-only dataset)). A `corpus:` section fills it."""
    corpus: Optional[CorpusConfig] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: LmConfig = field(default_factory=DiffEqFormerGpt2Config)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    hypernetwork_mu_dtype: Optional[str] = "auto"
    """Dtype in which Adam's first moment of a DiffEqFormer's hypernetwork projections is stored between
    steps (optax's `mu_dtype` rule, `qkvflow.training.adam`): `bfloat16`, or `float32` (null too) like
    every other moment. `auto`: bfloat16 for a new run; a resumed run keeps the dtype its checkpoint stores."""
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
    loss_vocab_block: Optional[int] = None
    """Vocabulary block of the cross-entropy (Levanter's `maybe_fused_next_token_loss`), for every model
    alike: null keeps each model's own (Levanter streams the vocabulary in blocks; a DiffEqFormer's
    `model.cross_entropy_block_size`); at least the vocabulary size computes the logits in one product,
    faster by the roofline of an H200 step and 7.6 GB bigger at 32 x 1024 tokens (docs/performance.md)."""
    nonfinite: str = "stop"
    """A step whose loss or gradients are not finite: `stop` ends the run (exit status 3, naming the
    step and where the values first appeared; nothing is saved for that step), `skip` leaves the model
    and optimizer state unchanged and goes on."""
    data_seed: Optional[int] = None
    verbose: bool = False
    """Show Levanter's log lines on the terminal too (they always go to `<trainer.log_dir>/<run_id>.log`)."""
    loss_curve: Optional[str] = "loss_curve.png"
    """File name of the loss-curve PNG, written beside the jsonl tracker's metrics.jsonl
    (runs/<run_id>/ by default) at the end of training; null to skip."""
