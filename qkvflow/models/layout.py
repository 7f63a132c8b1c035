"""Which parameter layout a DiffEqFormer's hypernetworks are stored in, and the conversion between them.

* stacked (the model's own, `qkvflow.models.generator.HyperGenerator`): `generator.mlps.{matrix,vector}.*`
  and `generator.projections.<names joined by +>`;
* per weight (checkpoints written before stacking, and every ODE export of format version 2,
  `qkvflow.models.per_weight.PerWeightGenerator`): `generator.weights.<name>.{proj, mlp.*}`.

The conversion only stacks or slices arrays, so a model converted either way computes what it computed.

    per_weight_model(model)          the model with its generator in the per-weight layout
    stacked_model(model)             the reverse
    per_weight_shape(build, *a, **k) the abstract model `build(*a, **k)` in the per-weight layout
    holds_per_weight(arrays)         whether a checkpoint's array names are the per-weight layout's
"""

import equinox as eqx

from qkvflow.models.generator import HyperGenerator
from qkvflow.models.per_weight import PerWeightGenerator

PREVIOUS = "generator/weights/"
"""How the per-weight layout's arrays are named in a checkpoint (under `model/`)."""


def _specs(model) -> dict:
    return model.config.flavour_spec.field.weight_specs(model.config)


def per_weight_model(model):
    generator = getattr(model, "generator", None)
    if not isinstance(generator, HyperGenerator):
        return model
    return eqx.tree_at(lambda m: m.generator, model, generator.per_weight())


def stacked_model(model):
    generator = getattr(model, "generator", None)
    if not isinstance(generator, PerWeightGenerator):
        return model
    return eqx.tree_at(lambda m: m.generator, model, HyperGenerator.from_per_weight(generator, _specs(model)))


def per_weight_shape(build, *args, **kwargs):
    """`eqx.filter_eval_shape` of the built model converted to the per-weight layout (nothing allocated)."""
    return eqx.filter_eval_shape(lambda: per_weight_model(build(*args, **kwargs)))


def is_stacked(model) -> bool:
    return isinstance(getattr(model, "generator", None), HyperGenerator)


def holds_per_weight(array_names) -> bool:
    """True if the checkpoint arrays `array_names` ("model/generator/weights/q/proj", ...) are per weight."""
    return any(name.startswith("model/" + PREVIOUS) for name in array_names)
