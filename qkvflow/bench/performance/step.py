"""The step `qkvflow bench speed` times: one full training step, compiled, as Levanter's trainer takes it.

Loss and gradient in the policy's compute dtype (`DTYPES`: jmp policies, parameters in f32), then the
optax update of Levanter's Adam at a fixed learning rate (`bench_optimizer`), jitted with the
parameters and optimizer state donated. `Step` builds, compiles and runs it on random tokens; a
DiffEqFormer with depth-dial recipes draws each step's grid from a key of its own.
"""

import time

import equinox as eqx
import haliax as hax
import jax
import jmp

from qkvflow.training.step import lm_loss, with_hypernetwork_mu_dtype

DTYPES = {"f32": "p=f32,c=f32", "bf16": "p=f32,c=bfloat16"}


def bench_optimizer(mu_dtype: str = "auto", **changes):
    """The benchmark's optimizer: Levanter's AdamConfig at a fixed learning rate (`changes` override its
    fields), with the hypernetwork projections' first moment in `mu_dtype` as `qkvflow train` stores it
    (`hypernetwork_mu_dtype`; `auto`, a new run's default: bfloat16)."""
    from levanter.optim import AdamConfig

    adam = AdamConfig(**({"learning_rate": 1e-4, "warmup": 0.0} | changes)).build(1_000_000)
    return with_hypernetwork_mu_dtype(adam, mu_dtype)


def train_step(static, policy, optimizer, vocab_block=None):
    """step(params, opt_state, example, key) -> (params, opt_state, loss): loss and gradient in the policy's
    compute dtype, then the optax update, as Levanter's trainer takes a step (`static`: the model's
    non-array part; `vocab_block`: the loss's, `loss_vocab_block`)."""

    def loss_fn(params, example, key):
        model = policy.cast_to_compute(eqx.combine(params, static))
        out = lm_loss(model, example, key=key, vocab_block=vocab_block)
        loss = out[0] if isinstance(out, tuple) else out
        return loss.scalar() if isinstance(loss, hax.NamedArray) else loss

    def step(params, opt_state, example, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(params, example, key)
        with jax.named_scope("optimizer_update"):  # benchmarks/profile_step.py finds it by this name
            updates, opt_state = optimizer.update(grads, opt_state, params=params)
            return eqx.apply_updates(params, updates), opt_state, loss

    return step


class Step:
    """A compiled training step of `config`, the way Levanter's trainer runs one."""

    def __init__(self, config, Vocab, Batch, dtype: str, *, seed: int = 0, vocab_block=None):
        from levanter.models.lm_model import LmExample

        key_model, key_tokens = jax.random.split(jax.random.PRNGKey(seed))
        model = config.build(Vocab, key=key_model)
        policy = jmp.get_policy(DTYPES[dtype])
        optimizer = bench_optimizer()
        params, static = eqx.partition(model, eqx.is_inexact_array)
        opt_state = optimizer.init(params)
        tokens = hax.random.randint(key_tokens, (Batch, config.max_Pos), 0, Vocab.size)
        example = hax.vmap(LmExample.causal, Batch)(tokens)

        # a DiffEqFormer with depth-dial recipes draws its grid from the training step's key (as in training)
        dial = getattr(config, "dial", None)
        self.key = jax.random.PRNGKey(seed + 1) if dial is not None and dial.active else None

        start = time.perf_counter()
        step = train_step(static, policy, optimizer, vocab_block)
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, example, self.key)
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - start
        self.state = (params, opt_state)
        self.example = example
        self.parameter_count = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
        self.times: list[float] = []
        self.loss = None
        self.peak_memory: dict | None = None

    def run(self) -> float:
        start = time.perf_counter()
        key = None if self.key is None else jax.random.fold_in(self.key, len(self.times))
        params, opt_state, loss = self.compiled(*self.state, self.example, key)
        loss.block_until_ready()
        elapsed = time.perf_counter() - start
        self.state, self.loss = (params, opt_state), float(loss)
        return elapsed
