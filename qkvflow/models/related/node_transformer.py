"""The N-ODE Transformer (Baier-Reinio & De Sterck, 2020) and its vanilla-transformer baseline.

N chained ODE blocks, each with its own parameters, over depth time t in [0, 1]:

    X_1(0) = embed(SOS b1..bL) + positions,   X_i(0) = X_{i-1}(1),
    X'(t)  = FFN_t(alpha X + MHSA_t(X)),                                   (paper eq. 4)

where every affine map is `x A + b + c t` (eq. 5). Attention is time-independent by default (c = 0,
the paper's choice; `time_attention=True` adds c t to Q, K, V and the output map). No LayerNorm, no
dropout, d/2 heads of size 2, FFN d -> d -> d with ReLU. The class is read from the SOS state through
a two-layer d -> d MLP and a softmax. Each block is solved by `qkvflow.integrate` with an adaptive
solver (tsit5 by default, dopri5 allowed; the paper used RK4 with step control), rtol = atol = 1e-5,
and the kinetic regulariser (eq. 6)

    R = lambda / (2 L) * sum_blocks int_0^1 ||X'(t)||_F^2 dt      (per string, L = tokens incl. SOS)

is `integrate(..., tokens=1)`'s augmented energy int ||X'||_F^2 dt, times lambda / (2 L).
Each example is solved separately (`jax.vmap` over the solve), so step counts and NFE are per string.

Padding: strings are padded to one width; PAD keys are masked out of attention and the field is zero
at PAD rows, so padded rows neither move nor feed real ones. The step controller's error norm is the
RMS over the real rows only (`real_rows_rms`), the norm an unpadded solve of the same string uses, so
padding changes neither a string's steps nor its NFE (diffrax's default RMS over every element would
count the zero-error PAD rows and loosen short strings' tolerance by up to sqrt(width / L)).

`causal=True` is the causal-LM adaptation: input `SOS b1..bL =`, causal mask, and the label is read
from the `=` state (the last real token) instead of SOS, with the loss on the label only.

Plain JAX pytrees (a dict of arrays) rather than Haliax modules: the model is d = 8 and its whole point
is one explicit equation; the tests rebuild it from the equations with numpy.
"""

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from qkvflow.data.parity import PAD, VOCAB
from qkvflow.errors import check
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import integrate


@dataclass(frozen=True)
class NodeTransformerConfig:
    """Hyperparameters of the N-ODE Transformer (`ode=True`) or the vanilla baseline (`ode=False`)."""

    hidden_dim: int = 8
    num_blocks: int = 2
    alpha: int = 1
    """1: X' = FFN(X + MHSA(X)); 0: X' = FFN(MHSA(X)) (paper eq. 4)."""
    time_attention: bool = False
    ode: bool = True
    causal: bool = False
    num_classes: int = 2
    max_len: int = 16
    solver: str = "tsit5"
    rtol: float = 1e-5
    atol: float = 1e-5
    max_steps: int = 512
    kinetic_lambda: float = 0.0

    def __post_init__(self):
        check(
            self.hidden_dim >= 2 and self.hidden_dim % 2 == 0, "model.hidden_dim", self.hidden_dim, "an even int >= 2"
        )
        check(self.num_blocks >= 1, "model.num_blocks", self.num_blocks, "an int >= 1")
        check(self.alpha in (0, 1), "model.alpha", self.alpha, "0 or 1")
        check(self.solver in ("tsit5", "dopri5"), "model.solver", self.solver, "tsit5 or dopri5 (adaptive RK)")
        check(self.rtol > 0, "model.rtol", self.rtol, "a positive float")
        check(self.atol > 0, "model.atol", self.atol, "a positive float")
        check(self.kinetic_lambda >= 0, "model.kinetic_lambda", self.kinetic_lambda, "a float >= 0")
        check(self.num_classes >= 2, "model.num_classes", self.num_classes, "an int >= 2")

    @property
    def num_heads(self) -> int:
        return self.hidden_dim // 2

    @property
    def ode_config(self) -> OdeConfig:
        return OdeConfig(solver=self.solver, rtol=self.rtol, atol=self.atol, max_steps=self.max_steps)


def _affine(key, d_in, d_out, timed):
    """x A + b (+ c t): A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) as torch.nn.Linear, b = c = 0."""
    bound = 1.0 / math.sqrt(d_in)
    p = {"A": jax.random.uniform(key, (d_in, d_out), minval=-bound, maxval=bound), "b": jnp.zeros(d_out)}
    if timed:
        p["c"] = jnp.zeros(d_out)
    return p


def apply_affine(p, x, t=0.0):
    """Eq. 5: x A + b + c t (c absent: time-independent)."""
    y = x @ p["A"] + p["b"]
    return y + p["c"] * t if "c" in p else y


def sinusoid(max_len, d):
    """Fixed sinusoidal positions (Vaswani et al. 2017)."""
    pos = np.arange(max_len)[:, None]
    freq = np.exp(-math.log(10000.0) * np.arange(0, d, 2) / d)
    pe = np.zeros((max_len, d), np.float32)
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq)
    return jnp.asarray(pe)


def init(config: NodeTransformerConfig, key, vocab: int = VOCAB) -> dict:
    """Parameters as a dict of arrays; `vocab` is the embedding's row count (PARITY's 5 tokens by default)."""
    d, ta = config.hidden_dim, config.time_attention and config.ode
    keys = iter(jax.random.split(key, 8 * config.num_blocks + 4))
    blocks = []
    for _ in range(config.num_blocks):
        block = {name: _affine(next(keys), d, d, ta) for name in ("q", "k", "v", "o")}
        block["ff1"] = _affine(next(keys), d, d, config.ode)
        block["ff2"] = _affine(next(keys), d, d, config.ode)
        if not config.ode:
            block["ln1"] = {"g": jnp.ones(d), "b": jnp.zeros(d)}
            block["ln2"] = {"g": jnp.ones(d), "b": jnp.zeros(d)}
        blocks.append(block)
    return {
        "embed": jax.random.normal(next(keys), (vocab, d)) / math.sqrt(d),
        "blocks": blocks,
        "head1": _affine(next(keys), d, d, False),
        "head2": _affine(next(keys), d, config.num_classes, False),
    }


def mhsa(p, x, mask, t, num_heads):
    """Multi-head self-attention, heads of size d / num_heads; `mask[i, j]`: query i may see key j."""
    n, d = x.shape
    q, k, v = (apply_affine(p[name], x, t).reshape(n, num_heads, d // num_heads) for name in "qkv")
    scores = jnp.einsum("qhc,khc->hqk", q, k) / math.sqrt(d // num_heads)
    scores = jnp.where(mask[None], scores, -1e9)
    out = jnp.einsum("hqk,khc->qhc", jax.nn.softmax(scores, axis=-1), v).reshape(n, d)
    return apply_affine(p["o"], out, t)


def field(t, x, block, mask, row_mask, config: NodeTransformerConfig):
    """Eq. 4: X' = FFN_t(alpha X + MHSA_t(X)), FFN_t(z) = relu(z A1 + b1 + c1 t) A2 + b2 + c2 t; 0 at PAD rows."""
    z = config.alpha * x + mhsa(block, x, mask, t, config.num_heads)
    dx = apply_affine(block["ff2"], jax.nn.relu(apply_affine(block["ff1"], z, t)), t)
    return dx * row_mask[:, None]


def _masked_rms(row_mask, error):
    """sqrt(mean of error^2 over the real rows' elements and any scalar leaves), 0 at 0 (as optimistix's
    `rms_norm`, whose gradient at 0 is kept finite the same way)."""
    total, count = jnp.zeros(()), jnp.zeros(())
    for leaf in jax.tree_util.tree_leaves(error):
        if leaf.ndim == 2:  # the token states [n, d]: real rows only
            total = total + jnp.sum(jnp.square(leaf) * row_mask[:, None])
            count = count + jnp.sum(row_mask) * leaf.shape[1]
        else:
            total, count = total + jnp.sum(jnp.square(leaf)), count + leaf.size
    zero = total == 0
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, total) / count))


def real_rows_rms(row_mask):
    """The controller's error norm for a padded string: RMS over its real rows (a pytree-safe partial)."""
    return jax.tree_util.Partial(_masked_rms, row_mask)


def _layer_norm(p, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def masks(tokens, config: NodeTransformerConfig):
    real = tokens != PAD
    mask = real[None, :] & jnp.ones((tokens.shape[0],) * 2, bool)
    if config.causal:
        mask = mask & jnp.tril(jnp.ones_like(mask))
    return mask, real.astype(jnp.float32)


def embed(params, tokens, config: NodeTransformerConfig):
    """X_1(0): token embeddings plus fixed sinusoidal positions, [n, d]."""
    return params["embed"][tokens] + sinusoid(config.max_len, config.hidden_dim)[: tokens.shape[0]]


def encode(blocks, x, mask, row_mask, config: NodeTransformerConfig):
    """The N blocks, X_i(0) = X_{i-1}(1): (X_N(1), sum_blocks int ||X'||_F^2 dt (0 for the vanilla model),
    NFE summed over blocks, steps summed over blocks)."""
    energy, nfe, steps = jnp.zeros(()), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    for block in blocks:
        if config.ode:
            fn = lambda t, y, args: field(t, y, args, mask, row_mask, config)  # noqa: E731
            x, e, stats = integrate(fn, x, block, config.ode_config, tokens=1, norm=real_rows_rms(row_mask))
            energy = energy + e
            nfe = nfe + stats.nfe.astype(jnp.int32)
            steps = steps + stats.num_steps.astype(jnp.int32)
        else:  # pre-LN residual encoder layer with the same d/2 heads and d -> d -> d FFN
            x = x + mhsa(block, _layer_norm(block["ln1"], x), mask, 0.0, config.num_heads)
            h = _layer_norm(block["ln2"], x)
            x = x + apply_affine(block["ff2"], jax.nn.relu(apply_affine(block["ff1"], h)))
    return x, energy, nfe, steps


def head_hidden(params, x):
    """The readout MLP's hidden layer relu(x H1 + h1); the logits are this times H2 (+ h2)."""
    return jax.nn.relu(apply_affine(params["head1"], x))


def forward_one(params, tokens, length, config: NodeTransformerConfig):
    """One string: (logits [classes], kinetic regulariser R, NFE summed over blocks)."""
    mask, row_mask = masks(tokens, config)
    x, energy, nfe, _ = encode(params["blocks"], embed(params, tokens, config), mask, row_mask, config)
    read = x[length - 1] if config.causal else x[0]
    logits = apply_affine(params["head2"], head_hidden(params, read))
    reg = config.kinetic_lambda / (2.0 * length) * energy
    return logits, reg, nfe


def forward(params, tokens, lengths, config: NodeTransformerConfig):
    """Batch: each example solved separately (vmap), so NFE [batch] is per string."""
    return jax.vmap(lambda tok, n: forward_one(params, tok, n, config))(tokens, lengths)


def loss_fn(params, tokens, lengths, labels, config: NodeTransformerConfig):
    """Mean cross-entropy on the label (+ mean kinetic regulariser); aux: (accuracy per example, NFE)."""
    logits, reg, nfe = forward(params, tokens, lengths, config)
    logp = jax.nn.log_softmax(logits)
    ce = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    correct = jnp.argmax(logits, -1) == labels
    return jnp.mean(ce + reg), (correct, nfe)
