"""Time each attention kernel qkvflow can select (qkvflow.nn.attention) on this machine: forward and
backward of causal self-attention, jitted, at a shape from a bench config (default: speed.yaml's).

    python benchmarks/attention_cpu.py [--batch 64 --seq 64 --heads 4 --head_size 32] [--dtype f32|bf16]

Prints one line per kernel: the median of `--repeats` timed calls (ms) and its IQR. On a CPU this is
how `auto` was chosen there (qkvflow.nn.attention.fastest); on a GPU the same script times cudnn.
"""

import argparse
import time

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.layers.attention import AttentionMask

from qkvflow.nn import attention


def time_kernel(kernel, q, k, v, repeats):
    def loss(q, k, v):
        out = attention.dot_product_attention(
            "position", "key_position", "head_size", q, k, v, mask=AttentionMask.causal(),
            attn_backend=attention.config_value(kernel),
        )  # fmt: skip
        return out.array.astype(jnp.float32).sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
    return np.asarray(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head_size", type=int, default=32)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernels", default=None, help="comma-separated (default: those that run on this backend)")
    args = p.parse_args()
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    B, H, T, D = (hax.Axis(n, s) for n, s in
                  (("batch", args.batch), ("heads", args.heads), ("position", args.seq), ("head_size", args.head_size)))  # fmt: skip
    K = T.alias("key_position")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = hax.random.normal(keys[0], (B, T, H, D)).astype(dtype)
    k, v = (hax.random.normal(key, (B, K, H, D)).astype(dtype) for key in keys[1:])
    platform = jax.default_backend()
    kernels = args.kernels.split(",") if args.kernels else {
        "cpu": ["xla", "vanilla", "jax_flash"], "gpu": ["cudnn", "xla", "vanilla", "jax_flash"],
        "tpu": ["splash", "xla", "vanilla", "jax_flash"]}[platform]  # fmt: skip
    print(f"{platform} ({jax.devices()[0].device_kind}), {args.dtype}, batch {args.batch} x seq {args.seq} x "
          f"{args.heads} heads x {args.head_size}; auto = {attention.resolve('auto', dtype)}")  # fmt: skip
    for kernel in kernels:
        t = time_kernel(kernel, q, k, v, args.repeats)
        q1, med, q3 = np.percentile(t, [25, 50, 75])
        print(f"{kernel:10s} forward+backward {med:8.2f} ms (IQR {q1:.2f}-{q3:.2f})", flush=True)


if __name__ == "__main__":
    main()
