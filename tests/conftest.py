import os

import pytest

# Tests run on the CPU; a few simulate several devices (see tests that set their own flags in subprocesses).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory):
    """The offline pydoc corpus and its tokenizer, built once per test session (its Levanter cache,
    built by the first training run, is then shared by every test that trains)."""
    from qkvflow.data.corpora import prepare_corpus

    root = tmp_path_factory.getbasetemp() / "shared_corpora"
    prepare_corpus("pydoc", str(root))  # reuses a finished build, publishes atomically
    return root
