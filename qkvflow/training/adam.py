"""What qkvflow sets in the Adam optimizer Levanter builds: the first moment of the hypernetwork projections
stored in a narrower dtype (`hypernetwork_mu_dtype`), and which parameters weight decay shrinks.

The projections hold almost all of a DiffEqFormer's parameters (d_emb times one layer's weights), so
their Adam state is most of its optimizer memory and traffic. optax's `scale_by_adam(mu_dtype=...)`
stores the first moment mu in `mu_dtype` between steps while each step computes in float32:

    mu_k = cast(b1 * mu_{k-1} + (1 - b1) g_k, mu_dtype)      (the update uses mu_k before the cast)

Levanter's `AdamConfig` builds `scale_by_adam` without that argument and for every leaf alike, so
`with_hypernetwork_mu_dtype` applies the same rule around the optimizer Levanter builds, to the leaves
under `generator.projections` only: it widens their stored mu to float32 before each update (exact) and
casts the new mu back after it. The second moment nu stays float32: with Levanter's beta2 = 0.95 a
bfloat16 nu would still move (each step changes it by 5%, over bfloat16's 0.4% spacing), but with a
beta2 of 0.999 its 0.1% steps would round away.

The default, `auto`, is bfloat16 for a new run; a resumed run keeps the dtype its checkpoint stores
(`for_resume`), so a run started with float32 moments continues exactly as it began. bfloat16 became
the default after two `qkvflow bench compare` studies found no change in quality (docs/performance.md).

**Weight decay**: ODE models decay what GPT-2's default decays.

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
import jax.numpy as jnp
import optax

from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.models.generator import stack_groups
from qkvflow.runs.checkpoint_arrays import array_dtypes

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
AUTO = "auto"
NEW_RUN = "bfloat16"
"""What `auto` means for a run that does not resume."""
SCOPE = ".projections["
"""Key-path text of the stacked hypernetwork projections (`qkvflow.models.generator.HyperGenerator`)."""


def resolve(value: Optional[str]):
    """The dtype `hypernetwork_mu_dtype` names for a new run (`auto`: bfloat16; null: float32); one line
    for anything else."""
    if value is None:
        return jnp.float32
    if value == AUTO:
        value = NEW_RUN
    if value not in DTYPES:
        raise UserError(f"hypernetwork_mu_dtype={value!r} is invalid: expected {AUTO}, null or one of {sorted(DTYPES)}")
    return DTYPES[value]


def stored_dtype(checkpoint: str) -> Optional[str]:
    """The dtype of the projections' first moment in a checkpoint's optimizer state (read from the arrays'
    metadata), or None if it holds none (no hypernetwork, or no optimizer state).

    qkvflow stores every projection's first moment in one dtype (`with_hypernetwork_mu_dtype`); a checkpoint
    holding several was not written by this rule, and no dtype to resume with follows from it: it is
    refused in one line naming the checkpoint and the dtypes, rather than resumed in one picked from them."""
    found = {
        dtype
        for key, dtype in array_dtypes(checkpoint).items()
        if key.startswith("opt_state/") and "/mu/" in key and "/projections/" in key
    }
    if len(found) > 1:
        raise UserError(
            f"checkpoint {checkpoint!r} holds the hypernetwork projections' first moments in several dtypes "
            f"{sorted(found)}, where qkvflow stores one: no hypernetwork_mu_dtype follows from it; start a new run "
            "(a new trainer.id) or resume from a checkpoint qkvflow wrote"
        )
    return found.pop() if found else None


def for_resume(value: Optional[str], checkpoint: Optional[str]) -> Optional[str]:
    """`hypernetwork_mu_dtype` for a run resuming from `checkpoint` (None: a new run, `value` unchanged):
    `auto` becomes the dtype the checkpoint stores; an explicit dtype must be that one (one line if not)."""
    stored = stored_dtype(checkpoint) if checkpoint else None
    if stored is None:
        return value
    if value == AUTO:
        return stored
    if resolve(value) != DTYPES.get(stored):
        raise UserError(
            f"hypernetwork_mu_dtype={value!r} but checkpoint {checkpoint!r} stores the first moments in {stored}: "
            f"resume with hypernetwork_mu_dtype: {AUTO} (or {stored}), or start a new run (a new trainer.id)"
        )
    return value


def is_projection(path) -> bool:
    return SCOPE in jax.tree_util.keystr(path)


def _cast_mu(state, dtype):
    """`state` with the projections' leaves of every Adam mu cast to `dtype`."""

    def fix(s):
        if not isinstance(s, optax.ScaleByAdamState):
            return s
        mu = jax.tree_util.tree_map_with_path(
            lambda path, m: m.astype(dtype) if is_projection(path) and m is not None else m, s.mu
        )
        return s._replace(mu=mu)

    return jax.tree_util.tree_map(fix, state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


def with_hypernetwork_mu_dtype(optimizer: optax.GradientTransformation, value: Optional[str]):
    """`optimizer` (Levanter's Adam) with the projections' mu stored in the dtype `value` names (float32 or
    null: unchanged). Each update computes in float32, as optax's `mu_dtype` does."""
    dtype = resolve(value)
    if dtype == jnp.float32:
        return optimizer

    def init(params):
        return _cast_mu(optimizer.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = optimizer.update(updates, _cast_mu(state, jnp.float32), params)
        return updates, _cast_mu(state, dtype)

    return optax.GradientTransformation(init, update)


# --- which parameters weight decay shrinks ---------------------------------------------------------------


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
