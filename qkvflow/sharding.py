"""Per-device memory of the parameters and optimizer state under Levanter's sharding, from shapes alone.

The hypernetwork projections `proj` (axes [time_embed, *target axes], e.g. [time_embed, embed,
heads, head_size]) hold almost all of a DiffEqFormer's parameters. They carry the axis names that
Levanter's parameter mapping shards: `embed` over the `data` mesh axis (FSDP), and `mlp` / `heads`
over the `model` mesh axis when they are listed in `trainer.tensor_parallel_axes`. This module
computes what each device holds, using the same mapping (`TrainerConfig.parameter_axis_mapping`),
Haliax's partition specs and JAX's shard shapes on an `AbstractMesh`, so that the paper's 1.86B
model can be checked without allocating it or having the devices.

    per_device_bytes(config.model, 50257, {"data": 8})
"""

from __future__ import annotations

import math
import warnings
from typing import Mapping, Optional, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from haliax.partitioning import pspec_for_axis
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

MESH_AXES = ("replica", "data", "model")  # Levanter's ResourceAxis names, in its mesh order


def parameter_axis_mapping(fsdp_axis="embed", tensor_parallel_axes: Optional[Sequence[str]] = None) -> dict:
    """Levanter's logical -> mesh axis mapping for parameters and optimizer state."""
    from levanter.trainer import TrainerConfig

    config = TrainerConfig(fsdp_axis=fsdp_axis, tensor_parallel_axes=list(tensor_parallel_axes or []) or None)
    return dict(config.parameter_axis_mapping)


def abstract_mesh(mesh_shape: Mapping[str, int]) -> AbstractMesh:
    sizes = {name: 1 for name in MESH_AXES}
    unknown = set(mesh_shape) - set(sizes)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected some of {MESH_AXES}")
    sizes.update(mesh_shape)
    return AbstractMesh(tuple(sizes[n] for n in MESH_AXES), MESH_AXES)


def state_shapes(model_config, vocab: Axis, optimizer=None, num_train_steps: int = 1000):
    """(model, optimizer state) as pytrees of shapes; the optimizer defaults to Levanter's AdamW."""
    from levanter.optim import AdamConfig

    optimizer = optimizer or AdamConfig()

    def init():
        model = model_config.build(vocab, key=jrandom.PRNGKey(0))
        return model, tx.init(eqx.filter(model, eqx.is_inexact_array))

    with warnings.catch_warnings():  # Levanter's schedules log to a tracker; there is none here
        warnings.simplefilter("ignore")
        tx = optimizer.build(num_train_steps)
        return eqx.filter_eval_shape(init)


def _spec(leaf, mapping) -> PartitionSpec:
    if isinstance(leaf, NamedArray):
        return pspec_for_axis(leaf.axes, mapping)
    return PartitionSpec()  # plain arrays (optimizer step counts, ...) are replicated


def _shard_shape(shape, spec: PartitionSpec, mesh: AbstractMesh) -> tuple[int, ...]:
    """The largest shard's shape (an uneven split rounds up, as XLA pads it)."""
    ways = []
    for i in range(len(shape)):
        axes = spec[i] if i < len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        ways.append(math.prod(mesh.shape[a] for a in axes))
    if all(size % w == 0 for size, w in zip(shape, ways)):
        return tuple(NamedSharding(mesh, spec).shard_shape(tuple(shape)))  # JAX's own answer
    return tuple(-(-size // w) for size, w in zip(shape, ways))


def array_bytes(tree, mapping, mesh) -> list[tuple[str, int, int]]:
    """(path, bytes on the fullest device, bytes unsharded) for each array of a tree of shapes."""
    from qkvflow.faults import leaf_paths

    is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_named)
    paths = leaf_paths(tree)  # one per array; a NamedArray has one
    out = []
    for path, leaf in zip(paths, leaves):
        array = leaf.array if is_named(leaf) else leaf
        if not isinstance(array, jax.ShapeDtypeStruct):
            continue
        itemsize = jnp.dtype(array.dtype).itemsize
        shard = _shard_shape(array.shape, _spec(leaf, mapping), mesh)
        out.append((path, math.prod(shard) * itemsize, math.prod(array.shape) * itemsize))
    return out


def per_device_bytes(
    model_config,
    vocab_size: int,
    mesh_shape: Mapping[str, int],
    *,
    fsdp_axis="embed",
    tensor_parallel_axes: Optional[Sequence[str]] = None,
    optimizer=None,
) -> dict[str, int]:
    """Bytes of parameters and optimizer state on the fullest device, and unsharded.

    `mesh_shape` names Levanter's mesh axes: {"data": FSDP degree, "model": tensor-parallel degree,
    "replica": pure data-parallel degree}. The vocabulary is padded as `qkvflow train` pads it
    (to a multiple of the mesh size its axis is sharded over, if any).
    """
    mapping = parameter_axis_mapping(fsdp_axis, tensor_parallel_axes)
    mesh = abstract_mesh(mesh_shape)
    vocab = Axis("vocab", vocab_size)
    if "vocab" in mapping:
        names = mapping["vocab"]
        ways = math.prod(mesh.shape[n] for n in ((names,) if isinstance(names, str) else names))
        vocab = Axis("vocab", -(-vocab_size // ways) * ways)
    model, opt_state = state_shapes(model_config, vocab, optimizer)
    params = sum(b for _, b, _ in array_bytes(model, mapping, mesh))
    params_total = sum(b for _, _, b in array_bytes(model, mapping, mesh))
    opt = sum(b for _, b, _ in array_bytes(opt_state, mapping, mesh))
    opt_total = sum(b for _, _, b in array_bytes(opt_state, mapping, mesh))
    devices = math.prod(mesh.shape.values())
    return {
        "devices": devices,
        "params": params,
        "opt_state": opt,
        "total": params + opt,
        "params_unsharded": params_total,
        "opt_state_unsharded": opt_total,
        "total_unsharded": params_total + opt_total,
    }
