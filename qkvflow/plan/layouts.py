"""The layouts `qkvflow plan --search` compiles (`qkvflow.plan.search`), and the overrides that set each.

A layout is what Levanter's trainer config sets without changing the training itself (the global
batch `trainer.train_batch_size` stays the config's):

- the mesh: `trainer.mesh.axes` {data: D, replica: R, model: M} with D x R x M = N, M over every
  divisor of N (tensor parallelism over `model`, Levanter's `shared_mapping` mlp/heads -> model);
- FSDP on or off: Levanter shards parameters and optimizer state over the `data` axis
  (`param_mapping` embed -> data) and replicates them over `replica`, and the batch splits over both
  (`DEFAULT_DP_AXES`). FSDP on is {data: N/M, replica: 1}, off is {data: 1, replica: N/M};
- the per-device batch b: `trainer.per_device_parallelism`, Levanter's microbatch per device; the step
  accumulates gradients over G / (b x N/M) microbatches (`levanter.grad_accum.microbatched`), so every
  b with G divisible by b x N/M is the same training at another memory and speed;
- remat, where the model's config has a key for it: `model.ode.checkpoints` of a fixed-grid ODE
  solved with diffrax's `RecursiveCheckpointAdjoint` (null keeps every step's state, a number K keeps
  K), or `model.gradient_checkpointing` of Levanter's discrete models (true or false).
"""

from __future__ import annotations

import dataclasses
import shlex

from qkvflow.errors import UserError


@dataclasses.dataclass(frozen=True)
class Layout:
    data_parallel: int  # devices the batch splits over
    model: int  # the tensor-parallel axis
    fsdp: bool
    remat: object  # the remat key's value (None: the key's null, or the model has no remat key)

    @property
    def axes(self) -> dict:
        """Levanter's `trainer.mesh.axes` for this layout."""
        d = self.data_parallel
        return {"data": d if self.fsdp else 1, "replica": 1 if self.fsdp else d, "model": self.model}


def remat_key(model_config) -> tuple[str | None, list]:
    """(the dotted key through which the config sets remat, its choices: the config's own value first);
    (None, [None]) for a model without one. A fixed-grid diffrax solve with recursive checkpointing may
    keep every step (null) or the config's K; with K = num_steps that is the same program as null."""
    ode = getattr(model_config, "ode", None)
    if ode is not None:
        if ode.adjoint != "recursive_checkpoint" or ode.is_adaptive or ode.loop != "diffrax":
            return None, [None]
        own = None if ode.checkpoints in (None, ode.num_steps) else ode.checkpoints
        return "model.ode.checkpoints", list(dict.fromkeys([own, None]))
    if hasattr(model_config, "gradient_checkpointing"):
        own = model_config.gradient_checkpointing
        return "model.gradient_checkpointing", list(dict.fromkeys([own, True, False]))
    return None, [None]


def with_remat(model_config, key: str | None, value):
    """`model_config` with the remat key set to `value`."""
    if key == "model.ode.checkpoints":
        return dataclasses.replace(model_config, ode=dataclasses.replace(model_config.ode, checkpoints=value))
    if key == "model.gradient_checkpointing":
        return dataclasses.replace(model_config, gradient_checkpointing=value)
    return model_config


def divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def layouts(devices: int, model_config, models=None, fsdp=(True, False), remats=None) -> tuple[list, list]:
    """(the layouts to compile, [(layout, why it is skipped)]): every model-axis size M in `models`
    (default: every divisor of `devices`), FSDP on and off, every remat choice; a layout that compiles
    to the same program as one listed before it is skipped."""
    key, choices = remat_key(model_config)
    if remats is not None and key == "model.ode.checkpoints":  # K = num_steps is null's program
        remats = list(dict.fromkeys(None if r == model_config.ode.num_steps else r for r in remats))
    todo, skipped = [], []
    for m in divisors(devices) if models is None else models:
        if devices % m:
            raise UserError(f"--search_model {m} does not divide --devices {devices}")
        for on in fsdp:
            for r in choices if remats is None else remats:
                layout = Layout(devices // m, m, on, r)
                if not on and layout.data_parallel == 1 and True in fsdp:
                    skipped.append((layout, "FSDP off is FSDP on with one data-parallel device: the same program"))
                    continue
                todo.append(layout)
    return todo, skipped


def batches(global_batch: int, data_parallel: int) -> list[int]:
    """The per-device batches b (ascending) for which `global_batch` splits into whole microbatches of
    b x `data_parallel` examples (Levanter's check on `per_device_parallelism`)."""
    if global_batch % data_parallel:
        return []
    return divisors(global_batch // data_parallel)


def configured(config, layout: Layout, per_device: int, key: str | None):
    """`config` laid out as `layout`, with microbatches of `per_device` examples per device."""
    t = config.trainer
    mesh = dataclasses.replace(t.mesh, axes={**t.mesh.axes, **layout.axes})
    trainer = dataclasses.replace(t, mesh=mesh, per_device_parallelism=per_device)
    return dataclasses.replace(config, trainer=trainer, model=with_remat(config.model, key, layout.remat))


def yaml_value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def overrides(layout: Layout, per_device: int, key: str | None) -> str:
    """The `--trainer.*` (and remat) overrides that give `layout`, as one line to paste."""
    axes = "{" + ", ".join(f"{k}: {v}" for k, v in layout.axes.items()) + "}"
    args = ["--trainer.mesh.axes", axes, "--trainer.per_device_parallelism", str(per_device)]
    if key is not None:
        args += [f"--{key}", yaml_value(layout.remat)]
    return shlex.join(args)


def parse_remat(text: str, key: str | None) -> list:
    """`--search_remat`'s comma-separated values as the remat key's values."""
    if key is None:
        raise UserError(
            "--search_remat: this model's config has no remat key (model.ode.checkpoints of a fixed-grid "
            "recursive_checkpoint solve, or model.gradient_checkpointing)"
        )
    out = []
    for word in (w.strip().lower() for w in text.split(",")):
        if key == "model.gradient_checkpointing" and word in ("true", "false"):
            out.append(word == "true")
        elif key == "model.ode.checkpoints" and (word == "null" or (word.isdigit() and int(word) >= 1)):
            out.append(None if word == "null" else int(word))
        else:
            expected = "true or false" if key == "model.gradient_checkpointing" else "null or an integer >= 1"
            raise UserError(f"--search_remat {word!r} is invalid for {key}: expected {expected}")
    return out
