"""`qkvflow describe`: parameter counts and FLOPs of a config, as one JSON object.

Shapes come from `jax.eval_shape`, so describing the paper's 1.86B-parameter model allocates nothing.
The vocabulary is the one training would use: the `corpus:` tokenizer's size (computed, nothing is
built), else `data.tokenizer` read from a local folder or the Hugging Face cache (nothing is
downloaded), else, for the default `gpt2`, GPT-2's 50,257 tokens. `vocab_source` says which.
"""

import json
from dataclasses import dataclass
from typing import Optional

from qkvflow.cli.startup import usage
from qkvflow.data.vocabulary import vocabulary
from qkvflow.models import accounting, registry
from qkvflow.runs import configfile
from qkvflow.runs.config import TrainConfig


@dataclass
class DescribeConfig(TrainConfig):
    vocab_size: Optional[int] = None
    """Vocabulary size to count embeddings with; by default the config's tokenizer's (see above)."""


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
    if usage.wants_help(argv):
        print(usage.short_help("qkvflow describe", DescribeConfig, "Parameter counts and FLOPs of a config, as JSON."))
        return 0

    config = configfile.parse(DescribeConfig, usage.full_listing_args(argv), "describe")
    print(json.dumps(describe(config), indent=2))
    return 0
