"""Training memory of a DiffEqFormer and its same-shape GPT-2, term by term, from shapes alone.

    python benchmarks/memory_breakdown.py [--batch 32] [--seq 1024] [--gpu_gib 80]

For the small / medium / large shapes of `benchmarks/configs/accelerator_*.yaml` and `configs/paper/`
(nothing is allocated: `jax.eval_shape`). Mixed precision as the configs train: f32 parameters, bf16
compute; Adam; per-layer (per-step) rematerialisation. Terms, in bytes:

* parameters 4 P, gradients 4 P, Adam's two moments 8 P, the bf16 compute copy of the parameters 2 P
  (`jmp`'s cast_to_compute): 18 P in all;
* ODE only: the generated weights W(t_k) for the N evaluation times in bf16 (2 N L, L = one layer's
  weights) and their gradient (2 N L), alive together in the backward pass;
* stored states, one per layer / step: 2 N B T H (bf16);
* one layer's rematerialised internals during its backward (Korthikanti et al. 2022, eq. 1, 16-bit
  activations, no recomputation inside the layer): B T H (34 + 5 a T / H) bytes, a heads;
* logits and their gradient, f32 over the whole vocabulary (qkvflow's loss without
  `cross_entropy_block_size`): 2 x 4 B T V.

Devices with FSDP (parameters, gradients, optimizer state sharded over the data axis, and the batch
split over it): the smallest power of two D with total / D <= 90% of `--gpu_gib`. This is an estimate
of the steady state; XLA's buffer assignment adds fragmentation and temporaries on top.
"""

import argparse

import jax
from haliax import Axis

from qkvflow.bench.performance.baseline import baseline_config
from qkvflow.integrate.config import OdeConfig
from qkvflow.models.accounting import count, model_shapes
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config

SHAPES = {  # name: (hidden, heads, N, d_emb), as benchmarks/configs/accelerator_*.yaml and configs/paper/owt_large_ode.yaml
    "small": (768, 12, 12, 64),
    "medium": (1024, 16, 24, 96),
    "large": (1280, 20, 36, 96),
}
VOCAB = 50257


def gpt2_params(config) -> int:
    import jax.random as jrandom
    from levanter.models.gpt2 import Gpt2LMHeadModel

    shapes = jax.eval_shape(lambda: Gpt2LMHeadModel.init(Axis("vocab", VOCAB), config, key=jrandom.PRNGKey(0)))
    return count(shapes)


def breakdown(name: str, batch: int, seq: int) -> dict:
    hidden, heads, n, d_emb = SHAPES[name]
    ode = DiffEqFormerGpt2Config(
        max_seq_len=seq, hidden_dim=hidden, num_heads=heads, time_embed_dim=d_emb, ode=OdeConfig(num_steps=n)
    )
    model = model_shapes(ode, VOCAB)
    proj = count(model.generator.projections)
    time_mlps = count(model.generator) - proj
    layer = proj // d_emb  # one layer's weights: each projection is d_emb x (that weight's shape)
    p_ode, p_gpt2 = count(model), gpt2_params(baseline_config(ode))
    tokens = batch * seq
    activ = {
        "stored states (bf16)": 2 * n * tokens * hidden,
        "one layer's internals": tokens * hidden * (34 + 5 * heads * seq / hidden),
        "logits + gradient (f32)": 2 * 4 * tokens * VOCAB,
    }
    rows = {}
    for label, p, table in (("DiffEqFormer", p_ode, 2 * 2 * n * layer), ("GPT-2", p_gpt2, 0)):
        terms = {"parameters (f32)": 4 * p, "gradients (f32)": 4 * p, "Adam moments (f32)": 8 * p}
        terms["bf16 compute copy"] = 2 * p
        terms["W(t_k) table + its gradient (bf16)"] = table
        terms.update(activ)
        rows[label] = {"params": p, "terms": terms, "total": sum(terms.values())}
    rows["DiffEqFormer"]["split"] = {"projections": proj, "time MLPs": time_mlps, "one layer": layer}
    return rows


def devices(total: float, gpu_gib: float) -> int:
    d = 1
    while total / d > 0.9 * gpu_gib * 2**30:
        d *= 2
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--gpu_gib", type=float, default=80.0)
    args = p.parse_args()
    tokens = args.batch * args.seq
    for name in SHAPES:
        rows = breakdown(name, args.batch, args.seq)
        split = rows["DiffEqFormer"]["split"]
        print(
            f"## {name} {SHAPES[name]} at {args.batch} x {args.seq}: DiffEqFormer {rows['DiffEqFormer']['params'] / 1e6:.1f}M "
            f"parameters = {split['projections'] / 1e6:.1f}M projections (d_emb x one layer's {split['one layer'] / 1e6:.2f}M) "
            f"+ {split['time MLPs'] / 1e6:.2f}M time MLPs + embeddings; GPT-2 {rows['GPT-2']['params'] / 1e6:.1f}M"
        )
        print("| term | DiffEqFormer GiB | GPT-2 GiB | DiffEqFormer bytes/token | GPT-2 bytes/token |")
        print("|---|---|---|---|---|")
        for term in rows["GPT-2"]["terms"]:
            a, b = rows["DiffEqFormer"]["terms"][term], rows["GPT-2"]["terms"][term]
            print(f"| {term} | {a / 2**30:.2f} | {b / 2**30:.2f} | {a / tokens:,.0f} | {b / tokens:,.0f} |")
        a, b = rows["DiffEqFormer"]["total"], rows["GPT-2"]["total"]
        print(f"| **total** | **{a / 2**30:.1f}** | **{b / 2**30:.1f}** | {a / tokens:,.0f} | {b / tokens:,.0f} |")
        print(
            f"ratio {a / b:.2f}; {args.gpu_gib:.0f} GiB GPUs with FSDP: DiffEqFormer {devices(a, args.gpu_gib)}, "
            f"GPT-2 {devices(b, args.gpu_gib)}\n"
        )


if __name__ == "__main__":
    main()
