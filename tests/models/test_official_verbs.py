"""`variant: official` through the verbs' three ways into a model: `qkvflow train` builds it, `eval` loads
the run (as `generate` and `export` do, qkvflow.runs.model) at its grid and at another depth,
LoRA `finetune` loads it as a pretrained base and discretises it; one tiny run, one process
(tests/train_utils.cli_in_one_process). The numerics are checked in-process elsewhere (test_official.py:
the reference equations, discretisation, the export's logits; cached decoding in tests/inference); here
a verb that rebuilt the checkpoint as qkvflow's variant, or refused the official one, fails."""

import math

import pytest

from tests.finetune_utils import TINY_FINETUNE
from tests.train_utils import TINY, cli_in_one_process, losses, train_env


@pytest.fixture(scope="module")
def official_verbs(tmp_path_factory, corpus_root):
    work = tmp_path_factory.mktemp("official-verbs")
    config = work / "official.yaml"
    text = open(TINY).read().replace("  type: diffeqformer_gpt2\n", "  type: diffeqformer_gpt2\n  variant: official\n")
    config.write_text(text.replace("root: cache/corpora", f"root: {corpus_root}"))
    outputs = [
        "--trainer.tracker", f"{{type: jsonl, path: {work / 'runs'}}}",
        "--trainer.log_dir", str(work / "logs"),
    ]  # fmt: skip
    run = work / "checkpoints" / "official"
    cases = {
        "train": ["train", "--config_path", str(config), "--trainer.id", "official", "--trainer.num_train_steps", "3",
                  "--trainer.checkpointer.base_path", str(work / "checkpoints"), *outputs],
        "eval": ["eval", "--config_path", str(config), "--checkpoint", str(run), "--steps", "2,4"],
        "finetune": ["finetune", "--config_path", TINY_FINETUNE, "--pretrained.config_path", str(config),
                     "--pretrained.checkpoint", str(run), "--trainer.id", "official-ft",
                     "--trainer.num_train_steps", "2", "--trainer.checkpointer.base_path", str(work / "ft"),
                     "--corpus.root", str(corpus_root), *outputs],
    }  # fmt: skip
    return work, cli_in_one_process(cases, train_env(1), cwd=work)


@pytest.mark.parametrize("verb", ["train", "eval", "finetune"])
def test_every_verb_runs_the_official_variant(official_verbs, verb):
    _, results = official_verbs
    code, _, stderr = results[verb]
    assert code == 0, stderr[-3000:]


def test_the_trained_variant_is_the_official_one(official_verbs):
    work, results = official_verbs
    assert all(math.isfinite(x) for x in losses(work, "official")) and len(losses(work, "official")) == 3
    rows = [line.split("|")[1:-1] for line in results["eval"][1].splitlines() if line.startswith("| euler |")]
    assert [r[1].strip() for r in rows] == ["N=2 (trained)", "N=4"]
    assert all(math.isfinite(float(r[3])) for r in rows) and rows[0][3] != rows[1][3]
