"""Cost of `qkvflow eval --per_sequence` against the batched adaptive solve, on whatever device JAX has.

    python benchmarks/per_sequence_nfe.py [--batch 8] [--seq 64] [--hidden 64] [--rtol 1e-2] [--repeat 3]

A random GPT-2-flavour DiffEqFormer (unit-scale token embeddings, time_scale 1, so that tsit5 takes a
handful of steps), one batch of random tokens: the batched forward solve (one step size for the batch)
and the per-sequence one (`hax.vmap` over the batch: a step size per sequence; diffrax's while loop runs
until the slowest sequence is done). Prints compile and run seconds (median of --repeat) and the counts.
"""

import argparse
import statistics
import time

import equinox as eqx
import haliax as hax
import jax
import jax.random as jrandom
import numpy as np

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config


def main():
    p = argparse.ArgumentParser()
    for name, default in (("batch", 8), ("seq", 64), ("hidden", 64), ("repeat", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rtol", type=float, default=1e-2)
    a = p.parse_args()
    ode = OdeConfig(num_steps=4, solver="tsit5", adaptive=True, rtol=a.rtol, atol=a.rtol / 10)
    config = DiffEqFormerGpt2Config(
        max_seq_len=a.seq, hidden_dim=a.hidden, num_heads=4, time_embed_dim=16, num_frequencies=16,
        time_scale=1.0, initializer_range=0.2, ode=ode,
    )  # fmt: skip
    Vocab, Batch = hax.Axis("vocab", 512), hax.Axis("batch", a.batch)
    model = config.build(Vocab, key=jrandom.PRNGKey(0))
    model = eqx.tree_at(lambda m: m.token_embeddings.weight, model, model.token_embeddings.weight * 10)
    ids = hax.random.randint(jrandom.PRNGKey(1), (Batch, config.max_Pos), 0, Vocab.size)
    batched = eqx.filter_jit(lambda m, x: m.flow(x)[2].nfe)
    alone = eqx.filter_jit(lambda m, x: hax.vmap(lambda y: m.flow(y)[2].nfe, Batch)(x))
    for name, fn in (("batched", batched), ("per-sequence", alone)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(model, ids))
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(model, ids))
            runs.append(time.perf_counter() - t0)
        print(
            f"{name:13s} first call {compile_s:6.2f} s  run {statistics.median(runs):.3f} s  nfe {np.asarray(out).tolist()}"
        )


if __name__ == "__main__":
    main()
