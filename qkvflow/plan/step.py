"""The training step `qkvflow train` runs, lowered and compiled for a target's devices.

The trainer is the one `qkvflow train` builds (`qkvflow.training.loop.make_trainer`: the config's
optimizer with its weight-decay mask and the non-finite guard, the `trainer.mp` policy, the
`trainer.mesh` axis mappings, `trainer.per_device_parallelism` microbatching) with the loss it trains
with (`qkvflow.training.loss.train_loss`). Its step is Levanter's jitted `Trainer._train_step` (the
variant without jit hooks, which is what runs when `trainer.watch` is off), lowered for

- the state `Trainer.initial_state` builds for a new run (`TrainerState.init` of the model
  `qkvflow train` builds), as shapes sharded by the parameter mapping;
- a batch as Levanter's data loader gives it: `train_batch_size` causal examples with segment ids
  from end-of-document tokens (Levanter's `block_cross_document_attention`), sharded by the compute
  mapping;

on a mesh of the target's devices laid out as `trainer.mesh` lays out the same number of devices.
An attention kernel left to `auto` is resolved for the target's platform, as the run there would
(qkvflow.nn.attention.fastest). What is not reproduced: a halting phase's frozen base, resuming.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import equinox as eqx
import haliax as hax
import haliax.tree_util as htu
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
from haliax.partitioning import infer_resource_partitions, round_axis_for_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from qkvflow.errors import UserError
from qkvflow.nn import attention
from qkvflow.plan.targets import Target
from qkvflow.training import step as training_step


def with_attention(model_config, platform: str, compute_dtype):
    """`model_config` with an unset `attn_backend` (Levanter's default) replaced by the kernel the
    process-wide choice ($QKVFLOW_ATTENTION, default auto) resolves to on `platform`."""
    from levanter.layers.attention import AttentionBackend

    backend = getattr(model_config, "attn_backend", None)
    if backend is not None and backend != AttentionBackend.DEFAULT:
        return model_config
    head = model_config.hidden_dim // model_config.num_heads
    kernel = attention.resolve(attention.process_choice(), compute_dtype, platform=platform, head_size=head)
    return dataclasses.replace(model_config, attn_backend=attention.config_value(kernel))


def node_of(device) -> int:
    """The node (TPU: slice) a device belongs to: a compile-only GPU topology's host (`process_index`,
    one per node of `backend.topology_string`), a TPU's `slice_index`; 0 for the host's own devices."""
    if device.platform == "tpu":
        return int(getattr(device, "slice_index", 0) or 0)
    return int(device.process_index)


def device_grid(ici: dict, dcn: dict, devices: list, node=node_of) -> np.ndarray:
    """The devices laid out as Levanter lays out a multi-slice mesh (`create_hybrid_device_mesh`): axes
    `ici` then the DCN-only ones, each node's devices a block of shape `ici` (in their order), the
    blocks tiled along the DCN axes. One node per slice: what Levanter's `TrainerConfig.num_slices`
    counts ("number of nodes"), read here from `node` because compile-only GPU devices carry no
    `slice_index`."""
    names = list(ici) + [k for k in dcn if k not in ici]
    ici_shape = [ici.get(n, 1) for n in names]
    dcn_shape = [dcn.get(n, 1) for n in names]
    by_node: dict = {}
    for d in devices:
        by_node.setdefault(node(d), []).append(d)
    if len(by_node) != math.prod(dcn_shape) or any(len(v) != math.prod(ici_shape) for v in by_node.values()):
        raise UserError(f"trainer.mesh: DCN axes {dcn} over {len(by_node)} nodes, ICI axes {ici} within each")
    blocks = np.empty(dcn_shape, dtype=object)
    for index, members in zip(np.ndindex(*dcn_shape), by_node.values()):
        grid = np.empty(len(members), dtype=object)
        grid[:] = members
        blocks[index] = grid.reshape(ici_shape)
    return np.block(blocks.tolist())


def mesh_for(trainer_config, devices: list):
    """The mesh Levanter builds from `trainer.mesh` for len(devices) devices on as many slices as the
    devices have nodes (`replica_dcn`, Levanter's data-parallel axis across slices, absorbs them
    unless `trainer.mesh.dcn_axes` says otherwise); one node: `create_mesh_from_axis_specs` itself."""
    from levanter.utils.mesh import create_mesh_from_axis_specs

    nodes = len({node_of(d) for d in devices})
    try:
        ici, dcn = trainer_config.mesh.axis_shapes(len(devices), nodes)
    except ValueError as e:
        raise UserError(f"trainer.mesh does not fit {len(devices)} devices: {e}") from None
    if nodes == 1 or devices[0].platform == "tpu":  # TPU chips carry their slice_index: Levanter's own layout
        return create_mesh_from_axis_specs(ici_axes=ici, dcn_axes=dcn, devices=devices)
    grid = device_grid(ici, dcn, devices)
    return jax.sharding.Mesh(grid, tuple(list(ici) + [k for k in dcn if k not in ici]))


def data_parallel(mesh_shape: dict) -> int:
    """Devices the batch is split over (Levanter's batch mapping: replica_dcn, replica, data)."""
    return math.prod(mesh_shape.get(axis, 1) for axis in ("replica_dcn", "replica", "data"))


def _sharded(tree, shardings, mesh):
    """`tree`'s arrays as ShapeDtypeStructs carrying `shardings` (replicated where there is none)."""

    def one(x, s):
        if isinstance(x, hax.NamedArray):
            return hax.NamedArray(one(x.array, s), x.axes)
        if isinstance(x, jax.ShapeDtypeStruct):
            s = s if s is not None else NamedSharding(mesh, PartitionSpec())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return x

    return htu.tree_map(one, tree, shardings)


def batch_shape(Batch, Pos, block_cross_document: bool):
    """The shape of a training batch: `Batch` causal examples of `Pos` tokens, as Levanter's text
    datasets build each one (segment ids from an end-of-document token)."""
    from levanter.data.text.examples import GrugLmExample, named_lm_example_from_grug

    def one(tokens):
        grug = GrugLmExample.causal(
            tokens=tokens.array, eos_id=0, block_cross_document_attention=block_cross_document
        )  # the id's value changes no shape
        return named_lm_example_from_grug(grug, Pos)

    tokens = hax.NamedArray(jax.ShapeDtypeStruct((Batch.size, Pos.size), jnp.int32), (Batch, Pos))
    return eqx.filter_eval_shape(hax.vmap(one, Batch), tokens)


def _step(trainer):
    """Levanter's jitted step, called from one jit over the abstract state and batch: haliax's
    `named_jit` lowers only concrete arrays; traced inside this one it is inlined, with its sharding
    of the outputs. The state is donated, as Levanter's `donate_args=(True,)` does."""

    def step(state, example):
        return trainer._jit_train_step_fn_no_hook(state, (example,), {})

    return step


def shard_bytes(tree, floating: bool = False) -> int:
    """Bytes of `tree`'s arrays (ShapeDtypeStructs with shardings) on the fullest device; `floating`:
    of its floating-point arrays only (a model's parameters, not its flags)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if floating and not jnp.issubdtype(getattr(leaf, "dtype", jnp.int32), jnp.inexact):
            continue
        if isinstance(leaf, jax.ShapeDtypeStruct):
            shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
            total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass
class Compiled:
    executable: object  # jax.stages.Compiled
    compile_s: float
    mesh_shape: dict
    vocab_size: int
    batch: int
    attention: str
    compute_dtype: str
    params_bytes: int  # per device, as the state holds them (trainer.mp's parameter dtype)
    optimizer_bytes: int
    batch_bytes: int
    trainable_params_bytes: int  # what the gradients take, in the parameter dtype
    partition_nodes: tuple = ()  # the node of each of the program's partitions (the mesh's devices in order)


def compile_step(config, target: Target, devices: list, vocab_size: int, batch: int | None = None) -> Compiled:
    """Compile `config`'s training step for `devices` (a target's) at global batch `batch` (default:
    `trainer.train_batch_size`)."""
    from levanter.tracker import NoopConfig
    from levanter.trainer_state import TrainerState

    t = config.trainer
    if batch is not None:
        t = dataclasses.replace(t, train_batch_size=batch)
    if not isinstance(t.train_batch_size, int):
        raise UserError("trainer.train_batch_size: plan needs one batch size, not a schedule")
    t = dataclasses.replace(t, tracker=NoopConfig(), id=t.id or "plan")  # compiling logs nothing
    compute = jnp.dtype(t.mp.compute_dtype)
    model_config = with_attention(config.model, target.platform, compute)
    config = dataclasses.replace(config, model=model_config, trainer=t)
    mesh = mesh_for(t, devices)
    dp = data_parallel(dict(mesh.shape))
    if t.train_batch_size % dp:
        raise UserError(
            f"trainer.train_batch_size={t.train_batch_size} does not divide over {dp} data-parallel devices"
        )
    with warnings.catch_warnings():  # Levanter's schedules warn that no tracker is set
        warnings.simplefilter("ignore")
        trainer = training_step.trainer(config, trainer_config=t)
    # the legacy mesh context and the abstract mesh, not jax.set_mesh: under that, the eager ops haliax
    # runs outside jit (its `is_in_jit` probe) would go to the compile-only devices, which run nothing
    with mesh, jax.sharding.use_abstract_mesh(mesh.abstract_mesh), hax.axis_mapping(trainer.parameter_axis_mapping):
        Vocab = round_axis_for_partitioning(hax.Axis("vocab", vocab_size), trainer.parameter_axis_mapping)
        model_key = jrandom.split(jrandom.PRNGKey(t.seed), 4)[2]
        training_key = jrandom.split(jrandom.PRNGKey(t.seed), 4)[3]

        def init():
            model = model_config.build(Vocab, key=model_key)
            return TrainerState.init(
                trainer.optimizer, model, key=training_key, is_trainable=True, mp=trainer.mp,
                quantization=t.quantization, model_averaging=t.model_averaging,
            )  # fmt: skip

        state = eqx.filter_eval_shape(init)
        state = _sharded(state, infer_resource_partitions(state, trainer.parameter_axis_mapping, mesh), mesh)
        example = batch_shape(t.TrainBatch, model_config.max_Pos, config.data.block_cross_document_attention)
        example = _sharded(example, infer_resource_partitions(example, trainer.compute_axis_mapping, mesh), mesh)
        start = time.perf_counter()
        try:
            executable = jax.jit(_step(trainer), donate_argnums=0).lower(state, example).compile()
        except Exception as e:  # noqa: BLE001 (XLA and tracing raise many kinds; one line names it)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise UserError(
                f"the training step does not compile for {target.name}: {type(e).__name__}: {first}"
            ) from None
    return Compiled(
        executable,
        time.perf_counter() - start,
        dict(mesh.shape),
        Vocab.size,
        t.train_batch_size,
        str(getattr(getattr(model_config, "attn_backend", None), "value", model_config.attn_backend)),
        str(compute),
        shard_bytes(state.model, floating=True),
        shard_bytes(state.opt_state),
        shard_bytes(example),
        shard_bytes(state.trainable_model, floating=True),
        tuple(node_of(d) for d in mesh.devices.flat),
    )
