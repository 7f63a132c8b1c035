"""`qkvflow describe`: parameter counts and FLOPs of a config, as one JSON object.

Shapes come from `jax.eval_shape`, so describing the paper's 1.86B-parameter model allocates nothing.
"""

import json
from dataclasses import dataclass

import levanter.config

from qkvflow.config import TrainConfig
from qkvflow.models import accounting
from qkvflow.models.config import DiffEqFormerConfig


@dataclass
class DescribeConfig(TrainConfig):
    vocab_size: int = 50257
    """Vocabulary size to count embeddings with (GPT-2's by default)."""


def describe(config: DescribeConfig) -> dict:
    model, vocab = config.model, config.vocab_size
    out = {"model_type": type(model).__name__, "vocab_size": vocab}
    if isinstance(model, DiffEqFormerConfig):
        out.update(accounting.parameter_counts(model, vocab))
        out["ode_solver"] = model.ode.solver
        out["ode_evaluations"] = accounting.nominal_evaluations(model)
        out["ode_evaluations_exact"] = not model.ode.is_adaptive
        out["hypernetwork_flops_per_forward"] = accounting.hypernetwork_flops_per_forward(model, vocab)
    else:
        shapes = accounting.model_shapes(model, vocab)
        out["total_params"] = accounting.count(shapes)
        out["hypernetwork_params"] = 0
    out["forward_flops_per_token"] = model.flops_per_token(vocab)
    return out


def main(argv: list[str]) -> int:
    def run(config: DescribeConfig):
        print(json.dumps(describe(config), indent=2))

    levanter.config.main(run, args=argv)()
    return 0
