"""Which parameters weight decay shrinks: ODE models decay what GPT-2's default decays.

Levanter's default mask (`OptimizerConfig.build_weight_decay_mask`) decides by name: it spares
`LayerNorm`, `RmsNorm` and `Embedding` modules and anything ending in `bias`, and decays every
other array. On a GPT-2 or Llama that is the weight matrices (and an untied output head). An ODE
model's parameters are the *generators* of its layer weights, whose names escape those rules, so
the default would also decay

* the hypernetworks that make the norm scales and biases (DiffEqFormer), and
* the norm scales themselves, towards 0, and the time biases c (weight-shared model).

For an ODE model whose optimizer config leaves both `weight_decay_modules` and
`default_weight_decay_mask` unset, `with_decay_mask` hands Levanter a regex instead
(`weight_decay_modules`, with `default_weight_decay_mask: false`) that matches exactly

* the generators of the weight *matrices* (`WeightSpec.kind == "matrix"`): the matrices' stacked
  projections and the weights (not biases) of the matrices' stack of time MLPs (DiffEqFormer, whose
  stacks never mix matrices with norms or biases, `qkvflow.models.generator`), or the constant
  matrix (weight-shared model);
* the untied output head (`lm_head`), as Levanter's Llama decays it.

Nothing else decays: norm scales and biases, their generators, the time biases c, a time MLP
shared by all weights (`shared_time_mlp`: it generates norms too), embeddings. A config that sets
either key itself gets Levanter's behaviour for it, unchanged.
"""

import dataclasses
import re
from typing import Optional

import equinox as eqx
import jax

from qkvflow.models import registry
from qkvflow.models.generator import stack_groups


def decay_regex(model_config) -> Optional[str]:
    """The `weight_decay_modules` regex (over root key paths) of an ODE model; None for other models,
    whose Levanter default is already the GPT-2 rule."""
    if not registry.is_ode(model_config):
        return None
    specs = model_config.flavour_spec.field.weight_specs(model_config)
    matrices = "|".join(sorted(re.escape(name) for name, spec in specs.items() if spec.kind == "matrix"))
    if model_config.generator == "shared":
        generated = rf"generator\.constants\.({matrices})"
    elif getattr(model_config, "variant", "qkvflow") == "official":  # q, k, v share the module q_k_v
        generated = rf"generator\.modules\.({matrices}|q_k_v)\.(weight\.weight|mlp\.lin\d+\.weight)"
    else:  # stacked hypernetworks: the matrices' projection groups and their stack of time MLPs
        groups = "|".join(re.escape(g.key) for g in stack_groups(specs) if g.kind == "matrix")
        generated = rf"generator\.(projections\.({groups})|mlps\.matrix\.lin\d+\.weight)"
    return rf"^({generated}|lm_head)$"


def with_decay_mask(optimizer, model_config):
    """`optimizer` with the ODE model's decay regex when the config chose no mask; otherwise unchanged."""
    regex = decay_regex(model_config)
    chose = optimizer.weight_decay_modules is not None or optimizer.default_weight_decay_mask is not None
    if regex is None or chose:
        return optimizer
    return dataclasses.replace(optimizer, weight_decay_modules=regex, default_weight_decay_mask=False)


def decayed_parameter_count(optimizer, model) -> int:
    """How many of `model`'s parameters `optimizer`'s decay mask decays (all of them without a mask;
    none when `weight_decay` is 0)."""
    if not getattr(optimizer, "weight_decay", 0.0):
        return 0
    arrays = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    mask_fn = optimizer.build_weight_decay_mask()
    if mask_fn is None:
        return sum(a.size for a in arrays)
    flags = jax.tree_util.tree_leaves(mask_fn(eqx.filter(model, eqx.is_array)))
    return sum(a.size for a, decays in zip(arrays, flags, strict=True) if decays)
