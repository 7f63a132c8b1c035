import atexit
import os
import shutil
import tempfile

import pytest

# Tests run on the CPU; a few simulate several devices (see tests that set their own flags in subprocesses).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def _session_compilation_cache() -> None:
    """One JAX compilation cache for the session, this process and every subprocess it starts (they
    inherit the variable): the tests train the same tiny models in many fresh processes, and a
    program compiled once is then loaded instead of compiled again. A directory of our own, removed at
    exit; a cache the caller set up (JAX_COMPILATION_CACHE_DIR already set) is used and kept."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="qkvflow-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


_session_compilation_cache()


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory):
    """The offline pydoc corpus and its tokenizer, built once per test session (its Levanter cache,
    built by the first training run, is then shared by every test that trains)."""
    from qkvflow.data.corpora import prepare_corpus

    root = tmp_path_factory.getbasetemp() / "shared_corpora"
    prepare_corpus("pydoc", str(root))  # reuses a finished build, publishes atomically
    return root
