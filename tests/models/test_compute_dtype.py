"""Mixed precision: under a bfloat16 compute policy (f32 parameters cast to bf16, as Levanter's trainer
and `qkvflow bench speed --dtype bf16` run a step) every matrix product of a DiffEqFormer's training
step takes bf16 operands, as a discrete transformer's do.

diffrax holds an ODE state in the promotion of y0's and the time's dtypes, so a bf16 embedding is
solved as an f32 state. Before the field cast it back on entry, every product of the field ran with an
f32 activation (tf32 on an H200: 0.43x the GPT-2's tokens/s, and cuDNN's attention refused the f32
query), and `loop: scan` stopped on a carry whose dtype changed in the first step.
"""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from levanter.models.lm_model import LmExample

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.depth_dial import DepthDialConfig
from qkvflow.training.loss import lm_loss
from tests.helpers import Batch, random_tokens, tiny_config, tiny_model

BF16 = jmp.get_policy("params=float32,compute=bfloat16,output=bfloat16")


def bf16_loss(config, seed=0, key=None):
    """The training loss as a function of the f32 parameters, computed under the bf16 policy."""
    model = tiny_model(config, seed)
    example = hax.vmap(LmExample.causal, Batch)(random_tokens(config))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params):
        out = lm_loss(BF16.cast_to_compute(eqx.combine(params, static)), example, key=key)
        out = out[0] if isinstance(out, tuple) else out
        return out.scalar() if isinstance(out, hax.NamedArray) else out

    return loss, params


def product_operand_dtypes(jaxpr) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in `jaxpr`, inside loops, checkpoints and calls too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += product_operand_dtypes(inner)
    return found


@pytest.mark.parametrize("loop", ["diffrax", "scan", "dial"])
def test_every_product_of_a_bf16_training_step_is_bf16(loop):
    """`dial`: the depth-dial training solves (drawn step counts, the consistency term's second solve,
    the Jacobian probe's jvp), qkvflow.models.depth_dial."""
    if loop == "dial":
        dial = DepthDialConfig(train_steps=[2, 3], consistency_weight=1.0, jacobian_weight=0.01)
        config = tiny_config(ode=OdeConfig(num_steps=3), dial=dial)
        loss, params = bf16_loss(config, key=jax.random.PRNGKey(2))
    else:
        loss, params = bf16_loss(tiny_config(ode=OdeConfig(num_steps=3, loop=loop)))
    dtypes = product_operand_dtypes(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr)
    # forward, recomputation and backward of attention, MLP, hypernetwork and unembedding
    assert len(dtypes) > 20
    assert [d for d in dtypes if d != ("bfloat16", "bfloat16")] == []


def test_the_solver_accumulates_in_f32_and_the_flow_returns_the_compute_dtype():
    """x(1) comes back in bf16 (the residual stream's dtype), but the Euler sums behind it ran in f32:
    within one bf16 ulp of x0 + sum_k dt F(t_k, x_k) accumulated in f32 from the bf16 field (each
    element), which the same sum accumulated in bf16, rounding each of N additions, is not."""
    from levanter.layers.attention import AttentionMask

    from qkvflow.integrate.weight_source import WeightSource

    n = 8
    config = tiny_config(ode=OdeConfig(num_steps=n))
    model = BF16.cast_to_compute(tiny_model(config))
    tokens = random_tokens(config)
    x1, _, _ = model.flow(tokens)
    assert x1.dtype == jnp.bfloat16

    pos = hax.arange(tokens.resolve_axis(model.Pos.name), dtype=jnp.int32)
    x0 = model.embed(tokens, pos)
    assert x0.dtype == jnp.bfloat16
    field = jax.jit(model.raw_field(x0.axes, jnp.bfloat16))
    args = (WeightSource.build(model.generator, config.ode), AttentionMask.causal(), pos)

    def euler(accumulate):
        y = x0.array.astype(accumulate)
        for k in range(n):
            y = y + (field(jnp.float32(k / n), y, args) * jnp.float32(1 / n)).astype(accumulate)
        return np.asarray(y.astype(jnp.float32))

    got = np.asarray(x1.array.astype(jnp.float32))
    ulp = lambda x: np.abs(x) * 2.0**-7 + 1e-30  # noqa: E731 (bf16: 8 significant bits)
    assert np.all(np.abs(got - euler(jnp.float32)) <= ulp(got))
    assert not np.all(np.abs(got - euler(jnp.bfloat16)) <= ulp(got))
