"""The model side of Levanter's `InferenceEngine`: `initial_cache(spec, *, dtype)` and
`decode(input_ids, kv_cache, batch_info, pos_ids, *, key=None) -> (logits, kv_cache)`.

The engine needs nothing else of a model than these two methods, `Vocab` and (for
`score_token_logprobs`) a call to the full forward; it never checks the model's class and passes it
through `jax.jit` as a pytree (`levanter.inference.engine._run_generation_loop`). So the decoders
here are wrappers (equinox modules), not methods added to the models: a wrapper holds what decoding
reuses at every token and training must not carry, above all the DiffEqFormer's weights W(t_k) at
every evaluation time, generated once (`generate_batched`) instead of by the hypernetwork in every
decode round, and the fixed grid N' that may differ from the training one.

* `OdeDecoder`: a DiffEqFormer (`DiffEqFormerLMHeadModel`, hypernetwork or shared generator), one
  cache per vector-field evaluation (`qkvflow.inference.schedule`).
* `ParallelDecoder`: the discretised model (`ParallelLMHeadModel`), one cache per block.

Levanter's own `LlamaLMHeadModel` has both methods and is used as it is (`decoder_for`).
"""

import dataclasses
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
from haliax import Axis, NamedArray
from levanter.layers.kv_cache import ListCache

from qkvflow.errors import UserError
from qkvflow.integrate.weight_source import generate_batched, weight_times
from qkvflow.models.diffeqformer import DiffEqFormerLMHeadModel
from qkvflow.models.discrete.model import ParallelLMHeadModel
from qkvflow.models.discrete.schemes import STAGES
from qkvflow.models.related.adaptive import AdaptiveLMHeadModel

from .paged import PagedAttend, empty_cache
from .schedule import Schedule, schedule


class _Decoder(eqx.Module):
    """What every decoder forwards to its model."""

    @property
    def Vocab(self) -> Axis:
        return self.model.Vocab

    @property
    def Pos(self) -> Axis:
        return self.model.Pos

    @property
    def config(self):
        return self.model.config

    def __call__(self, input_ids, attn_mask=None, *, key=None, pos_ids=None) -> NamedArray:
        """The uncached full-sequence forward (what `InferenceEngine.score_token_logprobs` calls)."""
        return self.model(input_ids, attn_mask, key=key, pos_ids=pos_ids)

    def _logits(self, x: NamedArray) -> NamedArray:
        return hax.dot(x, self.model.get_lm_head(), axis=self.model.config.Embed)


class OdeDecoder(_Decoder):
    """A DiffEqFormer as a model of `levanter.inference`: each vector-field evaluation of its fixed-step
    solve (every stage of every step, at its time t_k) is a layer with its own key/value cache, and
    `decode` runs the solver's Runge-Kutta combinations over those layers (`schedule.Schedule`)."""

    model: DiffEqFormerLMHeadModel
    """The model with `config.model.ode.num_steps` set to the decoding grid N'."""
    table: dict
    """W(t_k) for every evaluation time t_k of the grid, each weight with an `ode_time` axis."""
    plan: Schedule = eqx.field(static=True)

    @staticmethod
    def build(model: DiffEqFormerLMHeadModel, steps: Optional[int] = None) -> "OdeDecoder":
        ode = model.config.ode
        if steps is not None:
            if steps < 1:
                raise UserError(f"steps={steps} is invalid: expected an integer >= 1 (the fixed grid N')")
            ode = dataclasses.replace(ode, num_steps=steps)
            model = dataclasses.replace(model, _config=dataclasses.replace(model.config, ode=ode))
        plan = schedule(ode)  # refuses an adaptive solver
        table = generate_batched(model.generator, jax.numpy.asarray(weight_times(model.generator, ode)))
        return OdeDecoder(model, table, plan)

    def initial_cache(self, spec, *, dtype) -> ListCache:
        return ListCache([empty_cache(spec, self.config, dtype) for _ in range(self.plan.num_layers)])

    def decode(self, input_ids, kv_cache: ListCache, batch_info, pos_ids, *, key=None):
        model, config, plan = self.model, self.config, self.plan
        x = model.embed(input_ids, pos_ids)
        caches, layer = list(kv_cache), 0
        for step in plan.stages:
            ks = []
            for stage in step:
                y = x
                for a_ij, k_j in zip(stage.a, ks):
                    if a_ij != 0.0:
                        y = y + a_ij * k_j
                weights = jax.tree_util.tree_map(
                    lambda w, i=stage.time_index: w["ode_time", i], self.table, is_leaf=hax.is_named_array
                )
                attend = PagedAttend(caches[layer], batch_info)
                f = model.field.vector_field(weights, y, config=config, mask=None, pos_ids=pos_ids, attend_fn=attend)
                caches[layer], layer = attend.cache, layer + 1
                ks.append(plan.h * f.astype(x.dtype))
            for b_i, k_i in zip(plan.b, ks):
                if b_i != 0.0:
                    x = x + b_i * k_i
        return self._logits(model.final_norm(x)), ListCache(caches)


class ParallelDecoder(_Decoder):
    """A discrete parallel-block model (`ParallelLMHeadModel`) as a model of `levanter.inference`: one
    key/value cache per block, and per stage of a Runge-Kutta block (`block_scheme`)."""

    model: ParallelLMHeadModel

    def initial_cache(self, spec, *, dtype) -> ListCache:
        count = self.config.num_layers * STAGES[self.config.block_scheme]
        return ListCache([empty_cache(spec, self.config, dtype) for _ in range(count)])

    def decode(self, input_ids, kv_cache: ListCache, batch_info, pos_ids, *, key=None):
        inner = self.model.model
        x = inner.embed_tokens(input_ids)
        if inner.embed_positions is not None:
            x = x + inner.embed_positions.embed(pos_ids)
        caches, stages = list(kv_cache), STAGES[self.config.block_scheme]
        for i, block in enumerate(inner.layers.unstacked()):
            # a Runge-Kutta block attends once per stage, each from another state: a cache per stage
            attends = [PagedAttend(caches[i * stages + s], batch_info) for s in range(stages)]
            x = block(x, None, pos_ids, attends)
            caches[i * stages : (i + 1) * stages] = [a.cache for a in attends]
        return self._logits(inner.norm(x)), ListCache(caches)


def decoder_for(model, steps: Optional[int] = None):
    """The engine-facing decoder of `model`; `steps` (N') only for a DiffEqFormer."""
    if isinstance(model, DiffEqFormerLMHeadModel):
        return OdeDecoder.build(model, steps)
    if steps is not None:
        raise UserError(
            f"steps={steps}: only a DiffEqFormer has a grid to change; {type(model).__name__} has fixed layers"
        )
    if isinstance(model, AdaptiveLMHeadModel):
        raise UserError(
            f"{type(model).__name__} has exits (model.type adaptive_*): the KV-cached decoder has no exits or "
            "copied-up states; generate supports DiffEqFormer, parallel (discretised) and Llama models"
        )
    if isinstance(model, ParallelLMHeadModel):
        return ParallelDecoder(model)
    if hasattr(model, "decode") and hasattr(model, "initial_cache"):
        return model  # Levanter's Llama: the engine's own reference model
    raise UserError(
        f"{type(model).__name__} has no KV-cached decoding in Levanter (no decode/initial_cache): "
        "generate supports DiffEqFormer, parallel (discretised) and Llama models"
    )
