"""The task YAML that docs/evaluate.md shows (a `loglikelihood_rolling` perplexity of one's own documents)
runs as the page says: read from the page, through `qkvflow eval --tasks`, on a tiny checkpoint. The
rolling scores themselves are checked against the logits in tests/evaluation/test_harness.py."""

import json
import math
import re
from pathlib import Path

import pytest

from qkvflow.cli import main as cli_main
from tests.finetune_utils import TINY_TRAIN, save_fresh_checkpoint

pytest.importorskip("lm_eval")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "evaluate.md"


def _page_yaml(name: str) -> str:
    """The ```yaml block of the page whose first line is `# <name>`."""
    blocks = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(f"# {name}\n")]
    return block


def test_the_pages_rolling_perplexity_task_runs_as_written(tmp_path, corpus_root, capfd):
    """The YAML as printed, beside a my_docs.jsonl: one harness run whose three metrics are lm-eval's
    aggregations of one total log-likelihood, so bits per byte = log2(byte perplexity). (capfd: building
    the token cache needs a real stderr.)"""
    yaml = _page_yaml("my_perplexity.yaml")
    assert "output_type: loglikelihood_rolling" in yaml
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_perplexity.yaml").write_text(yaml)
    texts = ["The for statement iterates over the items of any sequence.", "A function definition defines a function."]
    (folder / "my_docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    checkpoint = save_fresh_checkpoint(tmp_path / "ckpt", corpus_root)
    rc = cli_main([
        "eval", "--config_path", TINY_TRAIN, "--corpus.root", str(corpus_root), "--checkpoint", str(checkpoint),
        "--tasks", str(folder / "my_perplexity.yaml"), "--output", str(tmp_path / "out"),
    ])  # fmt: skip
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    (run,) = json.loads((tmp_path / "out" / "depth.json").read_text())["lm_eval"]
    got = run["results"]["my_perplexity"]
    byte_ppl, bpb = got["byte_perplexity,none"], got["bits_per_byte,none"]
    assert 1 < byte_ppl < math.inf and got["word_perplexity,none"] > byte_ppl
    assert bpb == pytest.approx(math.log2(byte_ppl), rel=1e-6)
    assert "| my_perplexity | bits_per_byte |" in out
