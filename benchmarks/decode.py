"""Decoding speed: tokens/s with the KV cache (Levanter's InferenceEngine, `qkvflow.inference`) and
without it (the full forward re-run over the whole prefix for every new token), for a DiffEqFormer
and the same-shape discrete GPT-2 (the parallel-block GPT-2 of N layers, `parallel_gpt2`: Levanter's
own `Gpt2LMHeadModel` has no `decode`, so the engine cannot run it), at several generation lengths.

    python benchmarks/decode.py [--hidden 64] [--heads 4] [--steps 4] [--solver euler] [--context 128]
                                [--vocab 256] [--batch 4] [--prompt 8] [--lengths 16,64]

Random weights (speed does not depend on them); greedy decoding. Each measurement runs once to
compile and is then timed over one more run of the same shapes. Prints one JSON object per line.
"""

import argparse
import json
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
from haliax import Axis

from qkvflow.inference.decoders import decoder_for
from qkvflow.inference.generate import EngineSizes, SamplingOptions, generate
from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config
from qkvflow.models.discrete import ParallelGpt2Config


class ByteTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % self.vocab for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i % 128 for i in ids).decode("latin-1")

    def __len__(self):
        return self.vocab


def models(a):
    Vocab = Axis("vocab", a.vocab)
    ode = DiffEqFormerGpt2Config(
        max_seq_len=a.context, hidden_dim=a.hidden, num_heads=a.heads, ode=OdeConfig(num_steps=a.steps, solver=a.solver)
    )
    gpt2 = ParallelGpt2Config(max_seq_len=a.context, hidden_dim=a.hidden, num_heads=a.heads, num_layers=a.steps)
    key = jrandom.PRNGKey(0)
    return {"diffeqformer": ode.build(Vocab, key=key), "gpt2_parallel": gpt2.build(Vocab, key=key)}


def cached(model, prompts, new, batch):
    tok = ByteTokenizer(model.Vocab.size)
    decoder = decoder_for(model)
    opts = SamplingOptions(max_new_tokens=new)
    sizes = EngineSizes(max_seqs=batch, max_rounds=8)
    generate(None, tok, prompts, opts, decoder=decoder, sizes=sizes)  # compile
    start = time.perf_counter()
    out = generate(None, tok, prompts, opts, decoder=decoder, sizes=sizes)
    seconds = time.perf_counter() - start
    return sum(len(c.tokens) for c in out) / seconds


def uncached(model, prompts, new):
    """Greedy without a cache: each new token re-runs the forward over the whole prefix (padded to the
    final length, so one compiled shape; the model is causal)."""
    tok = ByteTokenizer(model.Vocab.size)
    ids = np.array([tok(p)["input_ids"] for p in prompts], dtype=np.int32)
    B, P = ids.shape
    Batch, Pos = Axis("batch", B), Axis("position", P + new)

    @eqx.filter_jit
    def next_token(model, tokens, at):
        logits = model(hax.named(tokens, (Batch, Pos)))
        return jnp.argmax(logits.array[:, at - 1], axis=-1)

    def run():
        tokens = jnp.zeros((B, P + new), jnp.int32).at[:, :P].set(ids)
        for at in range(P, P + new):
            tokens = tokens.at[:, at].set(next_token(model, tokens, at))
        return tokens.block_until_ready()

    run()
    start = time.perf_counter()
    run()
    return B * new / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="N: ODE steps, and layers of the GPT-2")
    p.add_argument("--solver", default="euler")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=8, help="prompt length in tokens")
    p.add_argument("--lengths", default="16,64", help="generation lengths")
    a = p.parse_args()
    rng = np.random.RandomState(0)
    prompts = ["".join(chr(c) for c in rng.randint(97, 123, a.prompt)) for _ in range(a.batch)]
    for name, model in models(a).items():
        for new in map(int, a.lengths.split(",")):
            row = {
                "model": name,
                "hidden": a.hidden,
                "N": a.steps,
                "solver": a.solver,
                "batch": a.batch,
                "prompt": a.prompt,
                "new_tokens": new,
                "device": jax.devices()[0].platform,
            }
            row["cached_tokens_per_s"] = round(cached(model, prompts, new, a.batch), 1)
            row["uncached_tokens_per_s"] = round(uncached(model, prompts, new), 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
