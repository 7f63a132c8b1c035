"""Shared by the fine-tuning tests: a tiny pretrained ODE checkpoint and `qkvflow finetune|sweep` runs."""

import json
import os
from pathlib import Path

from tests import warm
from tests.helpers import with_host_devices
from tests.timescale import limit

CLI_LIMIT = limit(900)
"""Seconds a fine-tuning command line may take (tests/timescale.py)."""

ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN = str(ROOT / "tests" / "configs" / "tiny_train.yaml")
TINY_FINETUNE = str(ROOT / "tests" / "configs" / "tiny_finetune.yaml")


def save_fresh_checkpoint(
    path: Path, corpus_root: Path, config_path: str = TINY_TRAIN, *extra: str, seed: int = 0
) -> Path:
    """A freshly initialised model of `config_path` (initialised with PRNGKey(seed)), saved as a Levanter
    checkpoint `path/step-0` with the `model` subtree that `qkvflow train` writes (seconds, instead of a
    training run)."""
    import jax
    import jax.random as jrandom
    import levanter.checkpoint
    import numpy as np
    from haliax import Axis

    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.corpus import with_corpus
    from tests.helpers import parse_config

    config = with_corpus(parse_config(config_path, TrainConfig, ["--corpus.root", str(corpus_root), *extra]))
    vocab = Axis("vocab", len(config.data.the_tokenizer))
    model = config.model.build(vocab, key=jrandom.PRNGKey(seed))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with jax.set_mesh(mesh):
        levanter.checkpoint.save_checkpoint({"model": model}, 0, str(path / "step-0"), is_temporary=False)
    return path


def base_args(workdir: Path, corpus_root: Path, pretrained: Path, *, config_path: str = TINY_FINETUNE) -> list[str]:
    return [
        "--config_path", config_path,
        "--pretrained.config_path", TINY_TRAIN,
        "--pretrained.checkpoint", str(pretrained),
        "--corpus.root", str(corpus_root),
        "--trainer.checkpointer.base_path", str(workdir / "checkpoints"),
        "--trainer.tracker", f"{{type: jsonl, path: {workdir / 'runs'}}}",
        "--trainer.log_dir", str(workdir / "logs"),
    ]  # fmt: skip


def url_data(data: Path, tokenizer: Path, cache: Path) -> list[str]:
    """Overrides that train and validate on the one JSONL file `data` (no corpus): a single url component
    `small` of Levanter's LmDataConfig, tokenized with `tokenizer`, cached under `cache`."""
    source = {"type": "url", "train_urls": [str(data)], "validation_urls": [str(data)]}
    return [
        "--corpus", "null", "--data.components", json.dumps({"small": {"source": source}}),
        "--data.tokenizer", str(tokenizer), "--data.cache_dir", str(cache),
    ]  # fmt: skip


def run_cli(verb: str, workdir: Path, *args: str, timeout=CLI_LIMIT):
    """`python -m qkvflow VERB ARGS` in `workdir` (a new process, tests/warm.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=with_host_devices(1))
    return warm.run([verb, *args], env, cwd=workdir, timeout=timeout)


def shared_setup(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus root, pretrained checkpoint run folder), shared by the fine-tuning and evaluation test
    modules: the tiny ODE model of tiny_train.yaml (N = 2 Euler steps) pretrained for 8 steps with
    `qkvflow train`, the session's reference run (tests/train_utils.reference_run, trained once), whose
    corpus folder already holds Levanter's token caches. A freshly initialised model would not do: its
    logits are too small for a few LoRA steps to move."""
    from tests.train_utils import reference_run

    corpora, workdir, proc = reference_run(tmp_path_factory)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return corpora, workdir / "checkpoints" / "tiny"


_FINETUNED: dict = {}
PRETRAINED_OVERRIDES = ("--model.initializer_range", "0.3")


def finetuned(tmp_path_factory, corpus_root: Path, method: str = "lora"):
    """(args, checkpoint, config, summary) of one tiny `qkvflow finetune` run per test session and
    `method` (lora or full), shared by the eval and generate tests: 2 steps at M = 4 layers, in this
    process (`summary["model"]` is the fine-tuned model in memory, LoRA unmerged), from a freshly
    initialised tiny ODE checkpoint (seconds, where a pretraining run takes half a minute). `args` are
    the command-line options that name its config, pretrained checkpoint, corpus and outputs."""
    from qkvflow.finetune.run import FinetuneConfig, finetune
    from tests.helpers import parse_config

    key = (str(tmp_path_factory.getbasetemp()), method)
    if key not in _FINETUNED:
        workdir = tmp_path_factory.mktemp(f"finetuned_{method}")
        # initial weights of std 0.3 rather than 0.02: logits of a few nats and blocks that matter, so that
        # two LoRA steps move the validation loss (from a near-uniform model they barely do)
        pretrained = save_fresh_checkpoint(workdir / "pretrained", corpus_root, TINY_TRAIN, *PRETRAINED_OVERRIDES)
        args = [*base_args(workdir, corpus_root, pretrained), "--finetune", method, "--trainer.num_train_steps", "2"]
        args += ["--pretrained.overrides", json.dumps(list(PRETRAINED_OVERRIDES))]
        config = parse_config(TINY_FINETUNE, FinetuneConfig, args[2:])
        summary = finetune(config)
        assert summary.get("finished"), summary
        _FINETUNED[key] = (args, workdir / "checkpoints" / summary["run_id"], config, summary)
    return _FINETUNED[key]
