"""A study's run configs read as `qkvflow train` reads them, before `qkvflow bench compare` trains anything.

Each model of a study becomes one `qkvflow train` config (the base config with the model's overlay;
`compare.run_config`). `parsed` checks such a config the way the `train` verb does before it starts
(`preflight.check_config_file`, Levanter 1.2's old keys, draccus's parse into `TrainConfig`, the values
`preflight.check_values` checks), so that a typo in a model's `type` or a key is refused in one line that
names the model, before the work folder is claimed. The parsed configs give what the accounting needs:
the vocabulary the runs will train on (`vocab_size`) and the training FLOPs of a run (`training_flops`).
"""

import dataclasses
import math
import os
import tempfile
from typing import Optional

import yaml

from qkvflow.data.corpora import corpus_vocab_size
from qkvflow.errors import UserError
from qkvflow.models import accounting, registry
from qkvflow.models.depth_dial import training_solves
from qkvflow.runs import compat, data_checks
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.configfile import _user_cause, parse
from qkvflow.training.step import check_values


def parsed(config: dict, where: str):
    """`config` (a `qkvflow train` config as a mapping) parsed into a `TrainConfig` as the verb parses it;
    a UserError in one line starting with `where` (e.g. "bench compare: model gpt2") when it is refused."""
    import draccus.utils

    fd, path = tempfile.mkstemp(prefix="qkvflow-study-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        try:
            compat.check_config(path)
            train_config = parse(TrainConfig, ["--config_path", path], "train")
            check_values(train_config)
        except UserError as e:
            raise UserError(f"{where}: {_one_line(str(e))}") from None
        except (draccus.utils.DecodingError, draccus.utils.ParsingError) as e:
            cause = _user_cause(e) or (e if isinstance(e, draccus.utils.DecodingError) else e.__cause__ or e)
            raise UserError(f"{where}: {_one_line(str(cause))}") from None
    finally:
        os.remove(path)
    return train_config


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def vocab_size(config) -> int:
    """The number of tokens the runs of `config` (a `TrainConfig`) train with: a bundled corpus's
    (`corpus_vocab_size`, nothing built), or the length of the `data:` section's tokenizer."""
    if config.corpus is not None:
        try:
            return corpus_vocab_size(config.corpus.name, vocab_size=config.corpus.vocab_size)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"bench compare: corpus {config.corpus.name}: {e}") from None
    return len(data_checks.load_tokenizer(config.data))


def training_flops(config, iters: int, vocab: Optional[int] = None) -> Optional[float]:
    """3 x forward FLOPs of one run of `config` (a `TrainConfig`) for `iters` steps: per-token FLOPs x
    tokens (Levanter's `flops_per_token`), plus an ODE's hypernetwork per forward pass
    (`accounting.hypernetwork_flops_per_forward`); with depth-dial recipes, the mean over the solves a
    batch runs (`depth_dial.training_solves`). None for a model Levanter has no FLOP count for."""
    vocab = vocab_size(config) if vocab is None else vocab
    seq, batch = config.model.max_seq_len, config.trainer.train_batch_size
    if config.model.flops_per_token(vocab, seq) is None:
        return None

    def forward(model) -> float:
        per_step = model.flops_per_token(vocab, seq) * seq * batch
        if registry.is_ode(model):
            per_step += accounting.hypernetwork_flops_per_forward(model, vocab)
        return per_step

    solves = [(config.model, 1.0)]
    dial = getattr(config.model, "dial", None)
    if dial is not None and dial.active:  # the drawn step counts' mean, and a consistency term's fine solve

        def at(n: int):
            return dataclasses.replace(config.model, ode=dataclasses.replace(config.model.ode, num_steps=n))

        solves = [(at(n), weight) for n, weight in training_solves(config.model)]
    return 3.0 * math.fsum(weight * forward(model) for model, weight in solves) * iters
