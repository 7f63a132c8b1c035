"""`qkvflow describe`: parameter counts and FLOPs of a config, as one JSON object.

Shapes come from `jax.eval_shape`, so describing the paper's 1.86B-parameter model allocates nothing.
The vocabulary is the one training would use: the `corpus:` tokenizer's size (computed, nothing is
built), else `data.tokenizer` read from a local folder or the Hugging Face cache (nothing is
downloaded), else, for the default `gpt2`, GPT-2's 50,257 tokens. `vocab_source` says which.
"""

import json
import os
from dataclasses import dataclass
from typing import Optional

from qkvflow.errors import UserError
from qkvflow.models import accounting, registry
from qkvflow.training.config import TrainConfig

GPT2_VOCAB = 50257


@dataclass
class DescribeConfig(TrainConfig):
    vocab_size: Optional[int] = None
    """Vocabulary size to count embeddings with; by default the config's tokenizer's (see above)."""


def vocabulary(config: DescribeConfig) -> tuple[int, str]:
    """(size, where it came from) of the vocabulary to count embeddings with."""
    if config.vocab_size is not None:
        if isinstance(config.vocab_size, bool) or config.vocab_size < 1:
            raise UserError(f"vocab_size={config.vocab_size!r} is invalid: expected null or an integer >= 1")
        return config.vocab_size, "vocab_size"
    if config.corpus is not None:
        from qkvflow.data.corpora import corpus_vocab_size
        from qkvflow.training.session import check_corpus

        c = config.corpus
        check_corpus(c)
        try:
            return corpus_vocab_size(c.name, vocab_size=c.vocab_size), f"corpus {c.name}"
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"corpus: {e}") from None
    name = getattr(config.data, "tokenizer", None)
    if name is None:
        raise UserError("data has no tokenizer to count the vocabulary with: pass --vocab_size N")
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(name, local_files_only=True)), f"data.tokenizer {name}"
    except Exception as e:  # noqa: BLE001 (HF raises OSError, ValueError, ...)
        if os.path.isdir(name):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(
                f"data.tokenizer={name!r} could not be loaded ({first}); expected a tokenizer folder"
            ) from None
        if name == "gpt2":
            return GPT2_VOCAB, "GPT-2's vocabulary (data.tokenizer gpt2, not in the local Hugging Face cache)"
        raise UserError(
            f"data.tokenizer={name!r} is not in the local Hugging Face cache: pass --vocab_size N "
            "(describe downloads nothing)"
        ) from None


def describe(config: DescribeConfig) -> dict:
    model = config.model
    vocab, source = vocabulary(config)
    out = {"model_type": type(model).__name__, "vocab_size": vocab, "vocab_source": source}
    if registry.is_ode(model):
        out.update(accounting.parameter_counts(model, vocab))
        out["ode_solver"] = model.ode.solver
        out["ode_evaluations"] = accounting.nominal_evaluations(model)
        out["ode_evaluations_exact"] = not model.ode.is_adaptive
        out["hypernetwork_flops_per_forward"] = accounting.hypernetwork_flops_per_forward(model, vocab)
    else:
        shapes = accounting.model_shapes(model, vocab)
        out["total_params"] = accounting.count(shapes)
        out["hypernetwork_params"] = 0
    out["forward_flops_per_token"] = model.flops_per_token(vocab, model.max_seq_len)
    return out


def main(argv: list[str]) -> int:
    from qkvflow import cli
    from qkvflow.cli import usage

    if usage.wants_help(argv):
        print(usage.short_help("qkvflow describe", DescribeConfig, "Parameter counts and FLOPs of a config, as JSON."))
        return 0

    config = cli.parse(DescribeConfig, usage.full_listing_args(argv), "describe")
    print(json.dumps(describe(config), indent=2))
    return 0
