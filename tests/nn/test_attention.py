"""qkvflow.nn.attention: every kernel a run can select computes softmax(q k^T / sqrt(d) + mask) v to the
dtype's round-off (reference: that equation in float64 numpy, from the same rounded inputs), with the
causal mask and with padding (segment ids), for plain and grouped heads; an unset `attn_backend` runs
the process-wide choice; `auto` is pinned per platform."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionBackend, AttentionMask

from qkvflow.nn import attention

B, T, D = hax.Axis("batch", 2), hax.Axis("position", 16), hax.Axis("head_size", 8)
S = T.alias("key_position")
PAD = 5  # the second sequence ends in PAD padding tokens (their own segment)
ON_GPU = jax.default_backend() == "gpu"


def inputs(dtype, heads):
    """q over `heads` (a tuple of axes), k and v over its first axis only (grouped heads when 2)."""
    rng = np.random.default_rng(3)
    q = hax.named(jnp.asarray(rng.standard_normal((B.size, *(h.size for h in heads), T.size, D.size)), dtype),
                  (B, *heads, T, D))  # fmt: skip
    k, v = (hax.named(jnp.asarray(rng.standard_normal((B.size, heads[0].size, S.size, D.size)), dtype),
                      (B, heads[0], S, D)) for _ in range(2))  # fmt: skip
    return q, k, v


def reference(q, k, v, heads, padded: bool):
    """The equation in float64 on the (already rounded) inputs; also the largest |logit| it met."""
    qa = np.asarray(q.rearrange((B, *heads, T, D)).array, np.float64)
    ka, va = (np.asarray(x.rearrange((B, heads[0], S, D)).array, np.float64) for x in (k, v))
    if len(heads) == 2:
        ka, va = ka[:, :, None], va[:, :, None]  # shared by the group
    logits = qa @ np.swapaxes(ka, -1, -2) / np.sqrt(D.size)
    allowed = np.tril(np.ones((T.size, S.size), bool))
    if padded:
        seg = segments()
        same = seg[:, :, None] == seg[:, None, :]
        allowed = allowed & same.reshape(B.size, *([1] * len(heads)), T.size, S.size)
    big = np.abs(np.where(allowed, logits, 0)).max()
    logits = np.where(allowed, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ va, big


def segments():
    seg = np.zeros((B.size, T.size), np.int32)
    seg[1, T.size - PAD :] = 1
    return seg


def mask_for(padded: bool) -> AttentionMask:
    mask = AttentionMask.causal()
    return mask.with_segment_ids(hax.named(jnp.asarray(segments()), (B, T))) if padded else mask


KERNELS = ["xla", "vanilla", "jax_flash", pytest.param("cudnn", marks=pytest.mark.gpu)]  # auto: one of these
CASES = [pytest.param(dtype, padded, False, id=f"{jnp.dtype(dtype).name}-{'padded' if padded else 'causal'}")
         for dtype in (jnp.float32, jnp.bfloat16) for padded in (False, True)]  # fmt: skip
CASES += [pytest.param(jnp.float32, True, True, id="float32-padded-grouped")]  # Llama's kv heads: k, v shared


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype, padded, grouped", CASES)
def test_kernel_matches_the_equation(kernel, dtype, padded, grouped):
    if kernel == "cudnn" and not ON_GPU:
        pytest.skip("cuDNN needs a GPU")
    if kernel == "cudnn" and dtype == jnp.float32:
        pytest.skip("cuDNN's flash attention takes 16-bit inputs only")
    heads = (hax.Axis("heads", 3), hax.Axis("group", 2)) if grouped else (hax.Axis("heads", 3),)
    q, k, v = inputs(dtype, heads)
    backend = attention.config_value(attention.resolve(kernel, dtype, head_size=D.size))
    out = jax.jit(lambda q, k, v: attention.dot_product_attention(
        T.name, S.name, D.name, q, k, v, mask=mask_for(padded), attn_backend=backend, flash_block_size=8,
    ))(q, k, v)  # fmt: skip
    assert out.dtype == dtype
    got = np.asarray(out.rearrange((B, *heads, T, D)).array, np.float64)
    expected, big = reference(q, k, v, heads, padded)
    # Round-off, to first order: a logit rounded to the dtype is off by up to eps/2 * |logit|, exp() makes
    # that the weight's relative error, and the output (a convex combination of v rows) inherits it
    # times max|v| (twice: the weight's own rounding), plus its own rounding (eps/2 * max|v|). The
    # kernels measured here stay within 0.14 of this bound.
    eps = float(jnp.finfo(dtype).eps)
    vmax = np.abs(np.asarray(v.array, np.float64)).max()
    tol = eps * (1 + big) * vmax
    np.testing.assert_allclose(got, expected, rtol=0, atol=tol)


def test_an_unset_backend_runs_the_process_choice(monkeypatch):
    calls = []
    real = attention.jax_nn_attention
    monkeypatch.setattr(
        attention, "jax_nn_attention", lambda *a, **k: calls.append(k["implementation"]) or real(*a, **k)
    )
    q, k, v = inputs(jnp.float32, (hax.Axis("heads", 2),))

    def run(backend):
        return jax.eval_shape(lambda q, k, v: attention.dot_product_attention(
            T.name, S.name, D.name, q, k, v, mask=AttentionMask.causal(), attn_backend=backend), q, k, v)  # fmt: skip

    monkeypatch.delenv(attention.ENV, raising=False)
    run(None)
    run(AttentionBackend.DEFAULT)
    assert calls == []  # auto on a CPU is Levanter's own default (jax_flash): left to Levanter
    monkeypatch.setenv(attention.ENV, "xla")
    run(None)
    run(AttentionBackend.DEFAULT)
    run(AttentionBackend.VANILLA)  # an explicit backend is kept
    assert calls == ["xla", "xla"]
    monkeypatch.setenv(attention.ENV, "flash2")
    with pytest.raises(ValueError, match="QKVFLOW_ATTENTION='flash2' is unknown"):
        run(None)


def test_auto_per_platform():
    assert attention.fastest("gpu", jnp.bfloat16, 64) == attention.fastest("gpu", jnp.float16, 128) == "cudnn"
    assert attention.fastest("gpu", jnp.float32, 64) == "xla"  # cuDNN's flash attention takes no f32
    assert attention.fastest("gpu", jnp.bfloat16, 256) == attention.fastest("gpu", jnp.bfloat16, 60) == "xla"
    assert attention.fastest("tpu", jnp.bfloat16) == "splash"
    assert attention.fastest("cpu", jnp.float32) == attention.fastest("cpu", jnp.bfloat16) == "jax_flash"
    assert attention.resolve("vanilla", jnp.float32) == "vanilla"
    with pytest.raises(ValueError, match="'flash3' is unknown"):
        attention.resolve("flash3", jnp.float32)


def test_levanter_models_look_it_up_here():
    import levanter.layers.attention
    import levanter.models.gpt2

    for module in (levanter.layers.attention, levanter.models.gpt2):
        assert module.dot_product_attention is attention.dot_product_attention
