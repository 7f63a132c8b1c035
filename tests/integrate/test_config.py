import pytest

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config

BAD = [
    (dict(num_steps=0), "ode.num_steps"),
    (dict(solver="rk45"), "ode.solver"),
    (dict(rtol=-1e-3, solver="dopri5"), "ode.rtol"),
    (dict(atol=0.0), "ode.atol"),
    (dict(adjoint="magic"), "ode.adjoint"),
    (dict(solver="euler", adaptive=True), "ode.adaptive"),
    (dict(checkpoints=0), "ode.checkpoints"),
    (dict(weight_cache="disk"), "ode.weight_cache"),
]


@pytest.mark.parametrize("kwargs,field", BAD)
def test_bad_ode_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as err:
        OdeConfig(**kwargs)
    assert "expected" in str(err.value)


@pytest.mark.parametrize(
    "kwargs,field,allowed",
    [
        (dict(hidden_dim=30, num_heads=4), "num_heads", "divisor of hidden_dim=30"),
        (dict(time_embed_dim=0), "time_embed_dim", ">= 1"),
        (dict(max_seq_len=0), "max_seq_len", ">= 1"),
        (dict(kinetic_weight=-1.0), "kinetic_weight", ">= 0"),
    ],
)
def test_bad_model_config_names_field_and_allowed(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        DiffEqFormerGpt2Config(**kwargs)
    assert err.value.args[0].startswith(f"{field}=") and allowed in err.value.args[0]


def test_unknown_solver_lists_allowed_values():
    with pytest.raises(ValueError, match="dopri5.*tsit5"):
        OdeConfig(solver="rk45")


def test_adaptive_defaults():
    assert OdeConfig(solver="dopri5").is_adaptive
    assert not OdeConfig(solver="heun").is_adaptive
    assert OdeConfig(solver="heun", adaptive=True).is_adaptive


def test_ode_config_defaults_are_pinned():
    """Every default of OdeConfig (the README and configs/ rely on them): the paper's fixed-step Euler with
    N = 12, diffrax-style tolerances for adaptive solves, and online checkpointing. A new field must be added here."""
    import dataclasses

    config = OdeConfig()
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} == {
        "num_steps": 12,
        "solver": "euler",
        "adaptive": None,
        "rtol": 1e-3,
        "atol": 1e-4,
        "max_steps": 256,
        "adjoint": "recursive_checkpoint",
        "checkpoints": None,
        "weight_cache": "precompute",
        "loop": "diffrax",
    }
    assert not config.is_adaptive
