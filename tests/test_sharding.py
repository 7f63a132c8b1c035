"""The hypernetwork projections shard with Levanter's FSDP and tensor-parallel mappings (`trainer.mesh`).

Per-device bytes of parameters and AdamW state for the paper's medium model (hidden 1024, 16 heads,
seq 1024, d_emb 144, GPT-2 vocabulary, 24 steps: 1.87B parameters) come from shapes alone
(`qkvflow.training.sharding.per_device_bytes`: `jax.eval_shape`, Haliax's partition specs, an `AbstractMesh`);
a subprocess with 8 simulated CPU devices checks that those numbers are what Levanter's sharded
initialisation really puts on each device (for a tiny model).
"""

import json
import os
from pathlib import Path

import pytest

from qkvflow.runs.config import TrainConfig
from qkvflow.training.sharding import (
    abstract_mesh,
    array_bytes,
    mesh_shape,
    parameter_axis_mapping,
    per_device_bytes,
    state_shapes,
)
from tests.helpers import parse_config, with_host_devices
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]
MEDIUM = str(ROOT / "configs" / "models" / "medium_d144.yaml")
GPT2_VOCAB = 50257
TOLERANCE = 0.01  # what FSDP cannot split: the time MLPs, biases without an `embed` axis, step counts


@pytest.fixture(scope="module")
def medium():
    model = parse_config(MEDIUM, TrainConfig).model
    assert (model.hidden_dim, model.num_heads, model.max_seq_len, model.time_embed_dim, model.ode.num_steps) == (
        1024,
        16,
        1024,
        144,
        24,
    )
    return model


@pytest.mark.parametrize("fsdp", [1, 2, 4, 8])
def test_fsdp_divides_parameters_and_adam_state(medium, fsdp):
    r = per_device_bytes(medium, GPT2_VOCAB, {"data": fsdp})
    assert 1.86e9 < r["params_unsharded"] / 4 < 1.875e9  # f32 parameters of the 1.86B model
    assert r["opt_state_unsharded"] == pytest.approx(2 * r["params_unsharded"], rel=1e-4)  # Adam's mu and nu
    ideal = r["total_unsharded"] / fsdp
    assert ideal <= r["total"] <= ideal * (1 + TOLERANCE), r["total"] / ideal
    assert r["params"] <= r["params_unsharded"] / fsdp * (1 + TOLERANCE)


def test_projections_dominate_and_split_exactly(medium):
    mapping = parameter_axis_mapping()
    model, _ = state_shapes(medium, _vocab())
    arrays = array_bytes(model, mapping, abstract_mesh({"data": 8}))
    proj = [(p, d, t) for p, d, t in arrays if p.startswith("generator.projections.")]
    assert sum(t for _, _, t in proj) > 0.85 * sum(t for _, _, t in arrays)
    big = [(p, d, t) for p, d, t in proj if t > 1e8]  # the matrices W(t) (their biases have no embed axis)
    assert len(big) >= 4
    for path, device, total in big:
        assert device * 8 == total, path


def test_tensor_parallel_over_mlp_and_heads(medium):
    """FSDP 4 x TP 2 on 8 devices: the projections split 8 ways; what stays over 1/8 is mostly the
    token embedding (vocab x embed: embed is split 4 ways, vocab is not tensor-parallel). Levanter's
    default mesh maps mlp and heads to the `model` axis, so giving it 2 devices is all TP takes."""
    r = per_device_bytes(medium, GPT2_VOCAB, {"data": 4, "model": 2})
    ideal = r["total_unsharded"] / 8
    assert ideal <= r["total"] <= ideal * 1.05, r["total"] / ideal
    mapping = parameter_axis_mapping()
    assert mapping["mlp"] == mapping["heads"] == "model" and mapping["embed"] == "data"
    model, _ = state_shapes(medium, _vocab())
    for path, device, total in array_bytes(model, mapping, abstract_mesh({"data": 4, "model": 2})):
        if path in ("generator.projections.w1", "generator.projections.w2", "generator.projections.q+k+v"):
            assert device * 8 == total, path
    fsdp_only = per_device_bytes(medium, GPT2_VOCAB, {"data": 8})
    assert r["total"] < 1.05 * fsdp_only["total"]
    # With mlp and heads mapped elsewhere (to the 1-device replica axis), the model axis only replicates:
    # each device then holds 1/4 (FSDP 4), so the prediction follows the mesh config's mapping.
    from levanter.utils.mesh import MeshConfig

    no_tp = MeshConfig(shared_mapping={"mlp": "replica", "heads": "replica"})
    replicated = per_device_bytes(medium, GPT2_VOCAB, {"data": 4, "model": 2}, mesh=no_tp)
    quarter = replicated["total_unsharded"] / 4
    assert quarter <= replicated["total"] <= quarter * (1 + TOLERANCE)


def test_mesh_shape_is_levanters():
    from levanter.utils.mesh import MeshConfig

    assert mesh_shape(MeshConfig(), 8) == {"data": 8, "replica": 1, "model": 1, "replica_dcn": 1}
    assert mesh_shape(MeshConfig(axes={"data": -1, "model": 2}), 8) == {
        "data": 4,
        "replica": 1,
        "model": 2,
        "replica_dcn": 1,
    }
    with pytest.raises(ValueError, match="unknown mesh axes"):
        abstract_mesh({"tensor": 2})


def _vocab():
    from haliax import Axis

    return Axis("vocab", GPT2_VOCAB)


_REAL_MESH = r"""
import json, sys
import numpy as np, jax, haliax as hax, equinox as eqx, jax.random as jrandom
from haliax import Axis
from levanter.optim import AdamConfig
from levanter.trainer import TrainerConfig
from levanter.utils.mesh import MeshConfig
from qkvflow.training.sharding import mesh_axes, mesh_shape, per_device_bytes
from tests.helpers import tiny_config

out = []
for axes in [{"data": -1}, {"data": -1, "model": 2}]:
    config = tiny_config()
    trainer = TrainerConfig(mesh=MeshConfig(axes=axes))
    mesh, mapping = trainer.device_mesh, trainer.parameter_axis_mapping  # as Levanter's Trainer builds them
    assert tuple(mesh.axis_names) == mesh_axes(trainer.mesh), (mesh.axis_names, mesh_axes(trainer.mesh))
    shape = mesh_shape(trainer.mesh, jax.device_count())
    assert dict(mesh.shape) == shape, (dict(mesh.shape), shape)
    tx = AdamConfig().build(1000)

    def init():
        m = config.build(Axis("vocab", 61), key=jrandom.PRNGKey(0))
        return m, tx.init(eqx.filter(m, eqx.is_inexact_array))

    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        state = hax.named_jit(init, axis_resources=mapping, out_axis_resources=mapping)()
    per_device = {}
    for leaf in jax.tree_util.tree_leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    predicted = per_device_bytes(config, 61, shape, mesh=trainer.mesh)
    out.append([max(per_device.values()), predicted["total"]])
print("RESULT", json.dumps(out))
"""


def test_prediction_matches_levanters_sharded_initialisation():
    """On 8 simulated devices, in a child of the warm interpreter (tests/warm.py) whose XLA backend starts
    with them."""
    from tests import warm

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_host_devices(8))
    proc = warm.run([_REAL_MESH], env, cwd=ROOT, timeout=limit(600), entry="tests.warm:exec_code")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    for measured, predicted in json.loads(lines[0][len("RESULT ") :]):
        assert measured == predicted
