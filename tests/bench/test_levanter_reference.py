"""benchmarks/levanter_reference.py's word-level tokenizer: GPT-2's vocabulary size, `t<i>` -> i, loaded the
same by Levanter (what its train_lm reads) and by transformers, and written without importing transformers."""

import json
import subprocess
import sys
from pathlib import Path

from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[2]

WRITE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import levanter_reference
levanter_reference.write_tokenizer(sys.argv[2])
print(json.dumps(sorted({"transformers", "torch"} & set(sys.modules))))
"""


def test_the_tokenizer_maps_each_word_to_its_number_in_levanter_and_transformers(tmp_path):
    folder = tmp_path / "tokenizer"
    proc = subprocess.run([sys.executable, "-c", WRITE, str(ROOT / "benchmarks"), str(folder)],
                          capture_output=True, text=True, timeout=limit(120))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []  # the script's ~5 s import of transformers and torch
    files = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in folder.iterdir()) == files

    from levanter.tokenizers import load_tokenizer
    from transformers import AutoTokenizer

    text = "t1 t50256 t7 t50257 word t300"
    expected = [1, 50256, 7, 0, 0, 300]  # t<i> is i for 1 <= i < 50257; anything else is <unk>, 0
    levanter, hf = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert levanter.encode(text, add_special_tokens=False) == expected
    assert hf(text, add_special_tokens=False)["input_ids"] == expected
    assert len(levanter) == len(hf) == 50257  # GPT-2's vocabulary size
    assert hf.unk_token == "<unk>" and hf.unk_token_id == 0 and hf.all_special_ids == [0]
    assert hf.decode([1, 50256, 7]) == "t1 t50256 t7"
