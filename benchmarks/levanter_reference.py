"""Levanter's own `train_lm` on GPT-2-small at bench speed's settings: the external reference point for
`benchmarks/accelerator.sh` ("our GPT-2 baseline runs as fast as Levanter runs it").

    python benchmarks/levanter_reference.py --out DIR [--batch 32] [--steps 20] [--dry-run]

Writes DIR/data.jsonl (random words t1..t50256, one token each under the word-level tokenizer written
to DIR/tokenizer: GPT-2's vocabulary size, no download, no network) and DIR/train_lm.yaml (GPT-2 small: 768 wide, 12 layers, 12 heads, context 1024, vocabulary
50257; bf16 compute, f32 parameters, Adam; Levanter's defaults otherwise, its attention backend
included), runs `python -m levanter.main.train_lm` on it in a subprocess, and writes DIR/summary.json:
tokens/s and MFU from Levanter's own throughput metrics (its json_file tracker), the median over the
steps after the first. `--dry-run`: a tiny GPT-2 on the CPU, for checking this script.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import yaml

SMALL = {"hidden_dim": 768, "num_layers": 12, "num_heads": 12, "max_seq_len": 1024}
TINY = {"hidden_dim": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 32}
VOCAB = 50257


def write_tokenizer(folder: str) -> str:
    """GPT-2's vocabulary size without its BPE (which Levanter would fetch from the Hub): a word-level
    tokenizer, `t<i>` -> i for i in 1..50256 and `<unk>` -> 0, saved in the Hugging Face folder layout
    (tokenizer.json, tokenizer_config.json, special_tokens_map.json) that Levanter and transformers load.
    Written with the `tokenizers` library alone: importing transformers (and with it torch) cost this
    script ~5 s per run."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    word_level = Tokenizer(models.WordLevel({"<unk>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.add_special_tokens(["<unk>"])
    word_level.save(os.path.join(folder, "tokenizer.json"))
    unk = {"content": "<unk>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
           "special": True}  # fmt: skip
    config = {"added_tokens_decoder": {"0": unk}, "clean_up_tokenization_spaces": False,
              "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}  # fmt: skip
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", {"unk_token": "<unk>"})):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    return folder


def write_inputs(out: str, batch: int, steps: int, dry_run: bool) -> str:
    model = TINY if dry_run else SMALL
    seq = model["max_seq_len"]
    rng = np.random.default_rng(0)
    with open(os.path.join(out, "data.jsonl"), "w") as f:
        for _ in range(batch * (steps + 2)):  # one document per sequence, a few to spare
            words = (f"t{i}" for i in rng.integers(1, VOCAB, seq + 1))
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    tokenizer_dir = write_tokenizer(os.path.join(out, "tokenizer"))
    config = {
        "data": {
            "tokenizer": tokenizer_dir,
            "enforce_eos": False,
            "cache_dir": os.path.join(out, "cache"),
            "components": {
                "random": {
                    "source": {"type": "url", "train_urls": [os.path.join(out, "data.jsonl")]},
                }
            },
        },
        "model": {"type": "gpt2", "tokenizer": tokenizer_dir, **model},
        "trainer": {
            "mp": "p=f32,c=f32" if dry_run else "p=f32,c=bfloat16",
            "train_batch_size": batch,
            "num_train_steps": steps,
            "steps_per_eval": 10**9,
            "tracker": {"type": "json_file", "output_path": os.path.join(out, "tracker")},
            "checkpointer": {"base_path": os.path.join(out, "checkpoints"), "save_interval": "1000h"},
            "log_dir": os.path.join(out, "logs"),
            "distributed": {"initialize_jax_distributed": False},  # one process
            "require_accelerator": not dry_run,
        },
        "optimizer": {"learning_rate": 1e-4, "warmup": 0.0},
    }
    path = os.path.join(out, "train_lm.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def summarise(out: str, batch: int, seq: int) -> dict:
    metrics = json.load(open(os.path.join(out, "tracker", "eval_results.json")))
    pick = lambda key: metrics.get(key, metrics.get(f"throughput/{key}"))  # noqa: E731
    mfu = pick("p50_mfu")
    return {
        "model": "Levanter gpt2 (levanter.main.train_lm)",
        "batch": batch,
        "tokens_per_step": batch * seq,
        "tokens_per_s": pick("tokens_per_second"),
        "mfu": None if mfu is None else mfu / 100.0,  # Levanter logs percent
        "mfu_samples": pick("mfu_sample_count"),
        "source": "Levanter's throughput metrics (last step's tokens/s, median MFU over its steps)",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    config = write_inputs(args.out, args.batch, args.steps, args.dry_run)
    cmd = [sys.executable, "-m", "levanter.main.train_lm", "--config_path", config]
    print("==", " ".join(cmd), flush=True)
    status = subprocess.run(cmd).returncode
    if status != 0:
        return status
    seq = (TINY if args.dry_run else SMALL)["max_seq_len"]
    summary = summarise(args.out, args.batch, seq)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
