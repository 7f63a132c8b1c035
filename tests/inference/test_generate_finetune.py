"""`qkvflow generate` on a `qkvflow finetune` (LoRA) checkpoint: the fine-tuned model's greedy text."""

import json

import draccus
import pytest

from qkvflow import cli
from tests.finetune_utils import TINY_FINETUNE, base_args, shared_setup
from tests.inference.util import greedy_reference, round_off

CONTEXT = 32


@pytest.mark.slow  # pretraining (shared) + 2 LoRA steps + generate: 3-6 min on a loaded 2-core CPU
def test_greedy_from_a_lora_checkpoint(tmp_path_factory, capfd):
    from qkvflow.training.finetune import FinetuneConfig, finetune

    corpora, pretrained = shared_setup(tmp_path_factory)
    workdir = tmp_path_factory.mktemp("ft_generate")
    args = base_args(workdir, corpora, pretrained)
    config = draccus.parse(
        FinetuneConfig, config_path=TINY_FINETUNE, args=[*args[2:], "--trainer.num_train_steps", "2"]
    )
    summary = finetune(config)
    trained = summary["model"]  # the fine-tuned model in memory, LoRA modules unmerged: the reference

    out = workdir / "out.jsonl"
    prompt, new = "The function", 6
    argv = ["generate", *args, "--checkpoint", str(workdir / "checkpoints" / summary["run_id"]), "--prompt", prompt,
            "--max_new_tokens", str(new), "--temperature", "0", "--output_jsonl", str(out)]  # fmt: skip
    assert cli.main(argv) == 0, capfd.readouterr().err
    record = json.loads(out.read_text())

    from qkvflow.cli.generate import tokenizer_of

    tokenizer = tokenizer_of(config)
    expected, margin = greedy_reference(trained, tokenizer(prompt, add_special_tokens=False)["input_ids"], new, CONTEXT)
    assert margin > round_off(4, 32, 1.0)
    assert record["tokens"] == expected
