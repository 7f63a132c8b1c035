"""`qkvflow generate` on a `qkvflow finetune` (LoRA) checkpoint: the fine-tuned model's greedy text.

The run is tests/finetune_utils.finetuned (2 LoRA steps at M = 4, shared with
tests/evaluation/test_finetuned.py); its fine-tuned model in memory (LoRA unmerged) is the reference.
"""

import json

from qkvflow import cli
from tests.finetune_utils import finetuned
from tests.inference.util import greedy_reference, round_off, training_framed

CONTEXT = 32


def test_greedy_from_a_lora_checkpoint(tmp_path_factory, corpus_root, capfd, tmp_path):
    from qkvflow.inference.completions import tokenizer_of

    args, checkpoint, config, summary = finetuned(tmp_path_factory, corpus_root, "lora")
    trained = summary["model"]  # the fine-tuned model in memory, LoRA modules unmerged: the reference

    out = tmp_path / "out.jsonl"
    prompt, new = "The function", 6
    argv = ["generate", *args, "--checkpoint", str(checkpoint), "--prompt", prompt,
            "--max_new_tokens", str(new), "--temperature", "0", "--output_jsonl", str(out)]  # fmt: skip
    assert cli.main(argv) == 0, capfd.readouterr().err
    record = json.loads(out.read_text())

    tokenizer = tokenizer_of(config)
    expected, margin = greedy_reference(trained, training_framed(tokenizer, prompt), new, CONTEXT)
    assert margin > round_off(4, 32, 1.0)
    assert record["tokens"] == expected


def test_steps_is_refused_for_a_finetune_checkpoint(tmp_path_factory, corpus_root, capfd):
    """A fine-tuning config's `steps` is the depth M of the model it trained: --steps there would rebuild
    another model (and fail at restore), so it is refused in one line before anything is loaded."""
    args, checkpoint, _config, _summary = finetuned(tmp_path_factory, corpus_root, "lora")
    for extra in (["--steps", "2"], ["--steps", "auto"], ["--auto_grids", "1,2"]):
        argv = ["generate", *args, "--checkpoint", str(checkpoint), "--prompt", "x", *extra]
        assert cli.main(argv) == 2
        err = capfd.readouterr().err.strip()
        assert "\n" not in err and f"{extra[0]}: " in err and "qkvflow finetune" in err, err
