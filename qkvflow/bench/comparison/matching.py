"""Matched baselines of `qkvflow bench compare`: a model declared by what it matches, solved on the study's data.

A study model may say, instead of a fixed width,

    gpt2_params:
      match: {params: ode}        # or {train_flops: ode}
      model: {type: gpt2, max_seq_len: 64, num_heads: 8, num_layers: 4}

Its `hidden_dim` is then solved before anything trains: the multiple of the head count (twice it for
rotary attention, whose head size must be even) whose measure m(width) is closest to the other model's,
|m(width) / m(target) - 1| smallest, on the study's own vocabulary, sequence length, batch and budget.
The measures come from `qkvflow.models.accounting` on the parsed run configs (`run_configs`):

* `params`: every parameter of the model (`accounting.count` of its shapes at the vocabulary);
* `train_flops`: the training FLOPs of one run (`run_configs.training_flops`: 3 x forward, Levanter's
  `flops_per_token`, an ODE's hypernetwork).

Both grow with the width, so the closest width lies beside the smallest width whose measure reaches the
target (found by doubling, then bisection). When even the narrowest width overshoots (a large vocabulary
or sequence makes the embeddings outweigh the target), the width cannot match and the layer count is
lowered, one layer at a time, until a width within `TOLERANCE` exists; a model that still cannot be matched
is refused in one line. The report prints each matched row's achieved ratio and marks one outside
`TOLERANCE`.
"""

import dataclasses
from typing import Callable

from qkvflow.bench.comparison import run_configs
from qkvflow.errors import UserError
from qkvflow.models import accounting

MEASURES = {"params": "parameters", "train_flops": "training FLOPs"}
TOLERANCE = (0.9, 1.1)
"""The ratios a matched row may have; the report marks one outside."""


def check(path: str, name: str, match, models: dict) -> None:
    """`models.<name>.match` of the study file `path`: one measure naming another model that is not matched
    itself; a UserError in one line otherwise."""
    where = f"bench compare: {path}: models.{name}.match={match!r}"
    if not isinstance(match, dict) or len(match) != 1 or next(iter(match)) not in MEASURES:
        raise UserError(f"{where} is invalid: expected one of {{params: MODEL}}, {{train_flops: MODEL}}")
    target = next(iter(match.values()))
    if target == name or target not in models:
        raise UserError(f"{where}: expected another model of the study, one of {sorted(set(models) - {name})}")
    if "match" in models[target]:
        raise UserError(f"{where}: {target} is matched itself; match to a model of fixed shape")
    own = models[name].get("model")
    if isinstance(own, dict) and "hidden_dim" in own:
        raise UserError(f"{where}: the model also sets hidden_dim={own['hidden_dim']}: drop it, the match solves it")


def within(ratio: float) -> bool:
    return TOLERANCE[0] <= ratio <= TOLERANCE[1]


def measure(kind: str, config, iters: int) -> Callable:
    """model config -> the measure `kind` of a run of `config` (a `TrainConfig`) with that model."""
    vocab = run_configs.vocab_size(config)
    if kind == "params":
        return lambda model: float(accounting.count(accounting.model_shapes(model, vocab)))
    return lambda model: run_configs.training_flops(dataclasses.replace(config, model=model), iters, vocab)


def solve(path: str, name: str, match: dict, config, target_config, iters: int) -> dict:
    """The shape of model `name` (`config`, a `TrainConfig` whose model's width is to be solved) that meets
    `match` ({measure: target}, `target_config` the target's): {"measure", "target", "solved": {"hidden_dim":
    w[, "num_layers": l]}, "value", "target_value", "ratio", "vocab_size"}, or a UserError in one line when
    no shape is within `TOLERANCE`."""
    ((kind, target),) = match.items()
    value_of = measure(kind, config, iters)
    goal = measure(kind, target_config, iters)(target_config.model)
    if goal is None or value_of(config.model) is None:
        raise UserError(f"bench compare: {path}: models.{name}.match: no {MEASURES[kind]} count for its model type")
    model = config.model
    step = model.num_heads * (2 if _rotary(model) else 1)
    layers = getattr(model, "num_layers", None)

    def closest(shape) -> tuple[int, float]:
        return _closest(lambda w: value_of(dataclasses.replace(shape, hidden_dim=w)), goal, step)

    width, value = closest(model)
    solved = {"hidden_dim": width}
    while value / goal > TOLERANCE[1] and width == step and layers is not None and layers > 1:
        layers -= 1  # the narrowest width overshoots: fewer layers
        width, value = closest(dataclasses.replace(model, num_layers=layers))
        solved = {"hidden_dim": width, "num_layers": layers}
    vocab = run_configs.vocab_size(config)
    if not within(value / goal):
        shape = ", ".join(f"{k} {v}" for k, v in solved.items())
        raise UserError(
            f"bench compare: {path}: models.{name}.match: the {MEASURES[kind]} of {target} ({goal:.4g} at vocabulary "
            f"{vocab}) cannot be met within {TOLERANCE[0]}-{TOLERANCE[1]}: the closest, {shape}, gives "
            f"{value / goal:.3f}x; change its num_heads or num_layers"
        )
    return {"measure": kind, "target": target, "solved": solved, "value": value, "target_value": goal,
            "ratio": value / goal, "vocab_size": vocab}  # fmt: skip


def _closest(value_of: Callable[[int], float], goal: float, step: int) -> tuple[int, float]:
    """The multiple w of `step` with |value_of(w) / goal - 1| smallest, for `value_of` increasing in w:
    the smallest k with value_of(k step) >= goal (doubling, then bisection), or k - 1."""
    values: dict[int, float] = {}

    def at(k: int) -> float:
        if k not in values:
            values[k] = value_of(k * step)
        return values[k]

    high = 1
    while at(high) < goal:
        high *= 2
        if high > 1 << 16:
            break
    low = high // 2  # at(low) < goal unless low is 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if at(mid) < goal else (low, mid)
    k = min((c for c in (low, high) if c >= 1), key=lambda c: abs(at(c) / goal - 1))
    return k * step, at(k)


def _rotary(model) -> bool:
    spec = getattr(model, "flavour_spec", None)
    return bool(getattr(spec, "rotary", False)) or getattr(model, "rope", None) is not None
