"""The model-family registry: one declaration per family, which every other layer looks up.

A family is one Levanter config type (`model: {type: NAME}` in YAML). It declares itself by decorating
its config class:

    @registry.register("diffeqformer_llama", flavour=LLAMA, ode=True, discretises_to="parallel_llama")
    @dataclass(frozen=True)
    class DiffEqFormerLlamaConfig(DiffEqFormerConfig):
        activation_function: ActivationFunctionEnum = ActivationFunctionEnum.silu

`register` registers the class with Levanter (`LmConfig.register_subclass`, so YAML selects it), sets
its `flavour` (the name) and `flavour_spec` (the `qkvflow.models.flavour.Flavour`, the block design
as data), and records a `Family`. What the rest of qkvflow asks about a model goes through the family:

* ODE or discrete (`is_ode`): the CLI's checks, evaluation grids, analyses, parameter/FLOP accounting;
* the flavour: fields, discrete blocks, accounting (`glu`), HF export names, benchmark baselines;
* the discretisation rule (`discrete_family`): the parallel config an Euler solve becomes
  (`qkvflow.models.discretise`).

The model class is the config's `model_type`, as in Levanter. Configs that qkvflow does not declare
(Levanter's own `gpt2`, `llama`) have no family: `family_of` gives None and `is_ode` False.

The families shipped with qkvflow are declared in `qkvflow.models.diffeqformer` and
`qkvflow.models.discrete.model`; `qkvflow.models` imports both, so importing any `qkvflow.models`
module registers them.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

from levanter.models.lm_model import LmConfig

from qkvflow.errors import UserError
from qkvflow.models.flavour import Flavour


@dataclass(frozen=True)
class Family:
    """What one model family declares (see the module docstring)."""

    name: str
    """The Levanter config type name, `model: {type: NAME}`."""
    config_class: type
    flavour: Flavour
    ode: bool
    """Continuous depth (weights W(t), a diffrax solve) rather than a fixed stack of layers."""
    discretises_to: Optional[str] = None
    """ODE families: the discrete family whose layers hold an Euler solve's W(t_k) (None: no discretisation)."""

    @property
    def model_class(self) -> type:
        """The `LmHeadModel` class the config builds (its `model_type`, Levanter's convention)."""
        return self.config_class.model_type.fget(None)


_FAMILIES: dict[str, Family] = {}


def register(name: str, *, flavour: Flavour, ode: bool, discretises_to: Optional[str] = None) -> Callable:
    """Class decorator (outside `@dataclass`): declare the config class as family `name`."""

    def declare(cls: type) -> type:
        if name in _FAMILIES:
            raise ValueError(f"model family {name!r} is declared twice ({_FAMILIES[name].config_class} and {cls})")
        cls.flavour = flavour.name
        cls.flavour_spec = flavour
        LmConfig.register_subclass(name)(cls)
        _FAMILIES[name] = Family(name, cls, flavour, ode, discretises_to)
        return cls

    return declare


def families() -> list[Family]:
    """Every declared family, by name."""
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def family(name: str) -> Family:
    """The family declared as `name`; an unknown name is a UserError that lists the known ones."""
    if name not in _FAMILIES:
        raise UserError(f"model.type={name!r} is not a qkvflow model family: expected one of {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def family_of(config) -> Optional[Family]:
    """The family of a config (instance or class): its nearest declared class; None for Levanter's own models."""
    cls = config if isinstance(config, type) else type(config)
    by_class = {f.config_class: f for f in _FAMILIES.values()}
    return next((by_class[c] for c in cls.__mro__ if c in by_class), None)


def type_name(config) -> str:
    """`model.type` as YAML writes it (Levanter's registered name), for messages."""
    cls = config if isinstance(config, type) else type(config)
    return LmConfig.get_choice_name(cls)


def is_ode(config) -> bool:
    """Whether the config describes a continuous-depth (ODE) model."""
    found = family_of(config)
    return found is not None and found.ode


def discrete_family(config) -> Family:
    """The family an ODE config's Euler solve discretises into (its declared `discretises_to`)."""
    found = family_of(config)
    if found is None or found.discretises_to is None:
        raise UserError(f"model.type={type_name(config)} declares no discretisation (discretises_to)")
    return family(found.discretises_to)


@contextlib.contextmanager
def only_named_types(names: Optional[set]):
    """Parse without Levanter's search for model types, when `names` are enough.

    `LmConfig` is a draccus plugin registry: the first parse or decode that meets a `model:` field imports
    every module of `levanter.models` to collect the registered types (~4.5 s of a CLI start-up on a
    2-core machine, most of it the transformers config classes those modules import). qkvflow's families
    are registered by importing `qkvflow.models`, and a Levanter type lives in `levanter.models.<type>`
    (gpt2, llama, mistral, ...). When every name in `names` is then registered, the search is marked as
    done for the duration of the block, and undone after it: a later lookup of another type still
    searches. `names` None (not known), or a name this does not find, keeps the search.

    It sets draccus's `PluginRegistry._did_discover_packages`, a private flag;
    tests/test_compat.py fails when draccus stops reading it."""
    import importlib

    skip = names is not None and not LmConfig._did_discover_packages
    for name in names or ():
        if skip and name not in LmConfig._choice_registry:
            try:
                importlib.import_module(f"levanter.models.{name}")
            except Exception:  # no such module, or one that fails to import: let draccus search and report
                skip = False
            skip = skip and name in LmConfig._choice_registry
    if skip:
        LmConfig._did_discover_packages = True
    try:
        yield
    finally:
        if skip:
            LmConfig._did_discover_packages = False


def decode(tree: dict) -> LmConfig:
    """`draccus.decode(LmConfig, tree)` for a `model:` mapping, without the search for Levanter's types when
    its `type` is found directly (`only_named_types`)."""
    import draccus

    name = tree.get("type") if isinstance(tree, dict) else None
    with only_named_types({name} if isinstance(name, str) else None):
        return draccus.decode(LmConfig, tree)
