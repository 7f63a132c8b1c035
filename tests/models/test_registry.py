"""The model-family registry is the one place a family declares itself.

The toy families below are declared in this file only, through `qkvflow.models.registry.register`
(no other qkvflow file knows them); YAML selects them, accounting counts them, they run, and an ODE
toy discretises by its declared rule. The reference parameter counts are written from the shapes.
"""

import dataclasses
from dataclasses import dataclass

import draccus
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.models.gpt2 import Gpt2Config
from levanter.models.lm_model import LmConfig
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.errors import UserError
from qkvflow.models import accounting, registry
from qkvflow.models.diffeqformer import DiffEqFormerConfig, DiffEqFormerGpt2Config
from qkvflow.models.discrete.model import ParallelConfig
from qkvflow.models.flavour import GPT2, LLAMA
from tests.helpers import Vocab, random_tokens, tiny_model
from tests.timescale import limit

# A discrete variant with a new flavour: Llama blocks, but learned absolute positions instead of rotary.
LEARNED_LLAMA = LLAMA.replace(name="llama_learned", learned_positions=True, rotary=False)


@registry.register("test_toy_parallel_llama_learned", flavour=LEARNED_LLAMA, ode=False)
@dataclass(frozen=True)
class ToyParallelConfig(ParallelConfig):
    pass


# An ODE variant: GPT-2 blocks with a ReLU feed-forward, discretised into Levanter-trainable parallel blocks.
@registry.register("test_toy_relu_ode", flavour=GPT2, ode=True, discretises_to="parallel_gpt2")
@dataclass(frozen=True)
class ToyReluOdeConfig(DiffEqFormerConfig):
    activation_function: ActivationFunctionEnum = ActivationFunctionEnum.relu


TINY = {"max_seq_len": 12, "hidden_dim": 32, "num_heads": 4}
TINY_ODE = TINY | {"time_embed_dim": 8, "num_frequencies": 16, "ode": {"num_steps": 2, "solver": "euler"}}


def from_yaml(type_name: str, fields: dict):
    return draccus.decode(LmConfig, {"type": type_name, **fields})


def test_a_discrete_toy_family_is_built_from_yaml_counted_and_run():
    config = from_yaml("test_toy_parallel_llama_learned", TINY | {"num_layers": 2})
    assert type(config) is ToyParallelConfig and config.flavour == "llama_learned"
    assert not registry.is_ode(config)
    # Parameters from the shapes: embeddings (tokens, learned positions), per layer q, k, v, o (no biases),
    # SwiGLU gate, up, down, two RMSNorm scales; the final RMSNorm; an untied head (Llama's default).
    h, m, P, V, L = 32, LLAMA.mlp_width(32), 12, Vocab.size, 2
    expected = V * h + P * h + L * (4 * h * h + 3 * h * m + 2 * h) + h + h * V
    assert m == 128  # SwiGLU's width: 8 * 32 // 3 = 85, rounded up to a multiple of 64
    assert accounting.count(accounting.model_shapes(config, V)) == expected
    model = tiny_model(config)
    assert model.model.embed_positions is not None
    logits = model(random_tokens(config)).array
    assert logits.shape[-1] == V and bool(jnp.all(jnp.isfinite(logits)))


def test_an_ode_toy_family_is_built_from_yaml_counted_run_and_discretised():
    from qkvflow.models.discretise import discretise

    config = from_yaml("test_toy_relu_ode", TINY_ODE)
    assert type(config) is ToyReluOdeConfig and registry.is_ode(config)
    assert config.activation_function is ActivationFunctionEnum.relu
    # The activation has no parameters: the counts are the GPT-2 DiffEqFormer's of the same shape.
    sibling = DiffEqFormerGpt2Config(**(TINY_ODE | {"ode": config.ode}))
    assert accounting.parameter_counts(config, Vocab.size) == accounting.parameter_counts(sibling, Vocab.size)
    model, gelu = tiny_model(config), tiny_model(sibling)  # same key: same weights, only the activation differs
    tokens = random_tokens(config)
    logits = np.asarray(model(tokens).array)
    assert np.isfinite(logits).all()
    assert np.abs(logits - np.asarray(gelu(tokens).array)).max() > 0  # ReLU, not the GELU default, is used
    discrete = discretise(model, config.ode.num_steps)
    assert registry.family_of(discrete.config).name == "parallel_gpt2"
    assert discrete.config.activation_function is ActivationFunctionEnum.relu
    # float32 round-off: folding dt into the output projections reorders one product per layer; measured
    # at about 2 ulps of the logits' scale for 2 steps, so 8 ulps per step.
    tol = 8 * np.finfo(np.float32).eps * np.abs(logits).max() * config.ode.num_steps
    assert np.abs(np.asarray(discrete(tokens).array) - logits).max() <= tol


@pytest.mark.parametrize("family", registry.families(), ids=lambda f: f.name)
def test_every_family_round_trips_its_type_name(family):
    config = from_yaml(family.name, {})
    assert type(config) is family.config_class
    assert LmConfig.get_choice_name(family.config_class) == family.name == registry.type_name(config)
    assert registry.family(family.name) is family and registry.family_of(config) is family
    assert config.flavour == family.flavour.name and config.flavour_spec is family.flavour
    assert isinstance(config.model_type, type) and family.model_class is config.model_type
    assert registry.is_ode(config) == family.ode
    if family.discretises_to is not None:
        assert not registry.family(family.discretises_to).ode


def test_the_shipped_families_are_declared():
    shipped = {f.name: (f.flavour.name, f.ode, f.discretises_to) for f in registry.families()}
    assert {k: v for k, v in shipped.items() if not k.startswith("test_")} == {
        "diffeqformer_gpt2": ("gpt2", True, "parallel_gpt2"),
        "diffeqformer_llama": ("llama", True, "parallel_llama"),
        "shared_ode_gpt2": ("gpt2", True, "parallel_gpt2"),
        "shared_ode_llama": ("llama", True, "parallel_llama"),
        "parallel_gpt2": ("gpt2", False, None),
        "parallel_llama": ("llama", False, None),
        "transevolve_gpt2": ("gpt2", False, None),
        "sequential_gpt2": ("gpt2", False, None),
        "node_transformer": ("gpt2", False, None),
        "adaptive_gpt2": ("gpt2", False, None),
        "halting_gpt2": ("gpt2", False, None),
    }


def test_an_unknown_name_is_a_one_line_user_error_listing_the_known_ones():
    with pytest.raises(UserError) as caught:
        registry.family("diffeqformer_gtp2")
    message = str(caught.value)
    assert "\n" not in message and "'diffeqformer_gtp2'" in message
    for family in registry.families():
        assert repr(family.name) in message


def test_levanters_own_models_have_no_family_and_are_not_odes():
    assert registry.family_of(Gpt2Config()) is None and not registry.is_ode(Gpt2Config())
    with pytest.raises(UserError, match="declares no discretisation"):
        registry.discrete_family(Gpt2Config())


def test_a_name_cannot_be_declared_twice():
    with pytest.raises(ValueError, match="declared twice"):
        registry.register("parallel_gpt2", flavour=GPT2, ode=False)(
            dataclass(frozen=True)(type("Again", (ParallelConfig,), {}))
        )
    assert registry.family("parallel_gpt2").config_class.__name__ == "ParallelGpt2Config"
    assert dataclasses.is_dataclass(registry.family("parallel_gpt2").config_class)


# A fresh process: in this one other tests have already run draccus's search of levanter.models.
_SEARCH = """
import json, sys
from levanter.models.lm_model import LmConfig
from qkvflow.runs.configfile import parse
from qkvflow.runs.config import TrainConfig

def state(config):
    return [type(config.model).__name__, sorted(m for m in sys.modules if m.startswith("levanter.models.")
            and m.split(".")[2] in LmConfig._choice_registry), LmConfig._did_discover_packages]

tiny, mistral = sys.argv[1:3]
out = {"tiny": state(parse(TrainConfig, ["--config_path", tiny], "train"))}
import qkvflow.cli.train, qkvflow.data.corpora, qkvflow.plotting, qkvflow.training.loop, qkvflow.training.session
out["train imports"] = sorted({"torch", "transformers"} & set(sys.modules))  # before a Levanter model's parse
out["mistral"] = state(parse(TrainConfig, ["--config_path", mistral, "--model.hidden_dim", "64"], "train"))
out["gpt2"] = state(parse(TrainConfig, ["--config_path", mistral, "--model", "{type: gpt2}"], "train"))
out["later lookup"] = LmConfig.get_choice_class("qwen").__name__
print(json.dumps(out))
"""


def test_a_parse_imports_only_the_levanter_model_types_it_names(tmp_path):
    """`qkvflow.runs.configfile.parse` spares draccus's search of every levanter.models module (~4.5 s of each
    CLI start-up) when the config names its model types: qkvflow's own families, or Levanter's
    `levanter.models.<type>`. The search stays marked undone afterwards, so a later lookup still finds
    every type. The train verb's modules import neither transformers nor torch."""
    import json
    import subprocess
    import sys

    from tests.train_utils import TINY

    (tmp_path / "mistral.yaml").write_text("model:\n  type: mistral\n")
    proc = subprocess.run([sys.executable, "-c", _SEARCH, TINY, str(tmp_path / "mistral.yaml")],
                          capture_output=True, text=True, timeout=limit(300))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tiny"] == ["DiffEqFormerGpt2Config", [], False]
    # mistral's module imports llama's (its base), not the other twenty-odd modules
    assert out["mistral"] == ["MistralConfig", ["levanter.models.llama", "levanter.models.mistral"], False]
    assert out["gpt2"] == [
        "Gpt2Config",
        ["levanter.models.gpt2", "levanter.models.llama", "levanter.models.mistral"],
        False,
    ]
    assert out["later lookup"] == "QwenConfig"
    # what `qkvflow train` imports spares transformers, and with it torch (~5 s of every training process)
    assert out["train imports"] == []


def test_model_types_reads_the_file_and_the_overrides_and_gives_up_when_unsure(tmp_path):
    from qkvflow.runs.configfile import model_types

    config = tmp_path / "c.yaml"
    config.write_text("model:\n  type: llama\n")
    assert model_types(str(config), ["--model.hidden_dim", "8", "--model.type", "gpt2"]) == {"llama", "gpt2"}
    assert model_types(None, ["--model={type: mistral}"]) == {"mistral"}
    assert model_types(None, ["--model.hidden_dim", "8"]) == set()  # the config class's default
    for unsure in (["--model", "[1, 2]"], ["--help"], ["--model.type"], ["--model", "{type: 3}"]):
        assert model_types(None, unsure) is None, unsure
    config.write_text("model: 3\n")
    assert model_types(str(config), []) is None


def test_draccus_still_skips_its_search_when_marked_done(monkeypatch):
    """Pins the private flag `registry.only_named_types` sets: draccus's PluginRegistry reads
    `_did_discover_packages` before importing the package given as `discover_packages_path`."""
    import importlib

    assert LmConfig.discover_packages_path == "levanter.models"
    imported = []
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: imported.append(a))
    monkeypatch.setattr(LmConfig, "_did_discover_packages", True)
    LmConfig._discover_packages()
    assert imported == []
    monkeypatch.setattr(LmConfig, "_did_discover_packages", False)
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: imported.append(a) or _EmptyPackage)
    LmConfig._discover_packages()
    assert imported == [("levanter.models", "draccus")] and LmConfig._did_discover_packages


class _EmptyPackage:
    __name__ = "levanter.models"
    __path__ = []
