"""Shared fixtures: one tiny DiffEqFormer, the pydoc corpus, and checkpoints that `load_model` reads."""

import levanter.checkpoint
import pytest
from haliax import Axis

from tests.analysis.builders import filled
from tests.helpers import tiny_config

TINY_MODEL_YAML = """
model:
  type: diffeqformer_gpt2
  max_seq_len: 12
  hidden_dim: 32
  num_heads: 4
  time_embed_dim: 8
  num_frequencies: 16
  ode:
    num_steps: 4
"""
GPT2_YAML = """
model:
  type: gpt2
  max_seq_len: 12
  hidden_dim: 32
  num_heads: 4
  num_layers: 3
"""


@pytest.fixture(scope="session")
def tiny_gpt2():
    """(config, model): the tests' tiny GPT-2-flavour DiffEqFormer (vocabulary 61), random weights."""
    config = tiny_config("gpt2")
    return config, filled(config)


def _write_config(path, corpus_root, model_yaml: str) -> str:
    path.write_text(f"corpus:\n  name: pydoc\n  root: {corpus_root}\n{model_yaml}")
    return str(path)


def _save(model, run_dir) -> str:
    path = str(run_dir / "step-0")
    levanter.checkpoint.save_checkpoint({"model": model}, step=0, checkpoint_path=path, is_temporary=False)
    return str(run_dir)


@pytest.fixture(scope="session")
def diffeqformer_run(tmp_path_factory, corpus_root):
    """(config path, checkpoint dir) of a tiny DiffEqFormer over the pydoc tokenizer, saved untrained."""
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.corpus import with_corpus
    from tests.helpers import parse_config

    workdir = tmp_path_factory.mktemp("diffeqformer_run")
    config_path = _write_config(workdir / "tiny.yaml", corpus_root, TINY_MODEL_YAML)
    config = parse_config(config_path, TrainConfig)
    vocab = Axis("vocab", len(with_corpus(config).data.the_tokenizer))
    return config_path, _save(filled(config.model, vocab), workdir / "checkpoints")


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory, corpus_root):
    """(config path, checkpoint dir) of a tiny discrete Levanter GPT-2 with random weights."""
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.corpus import with_corpus
    from tests.helpers import parse_config

    workdir = tmp_path_factory.mktemp("gpt2_run")
    config_path = _write_config(workdir / "gpt2.yaml", corpus_root, GPT2_YAML)
    config = parse_config(config_path, TrainConfig)
    vocab = Axis("vocab", len(with_corpus(config).data.the_tokenizer))
    return config_path, _save(filled(config.model, vocab), workdir / "checkpoints")
