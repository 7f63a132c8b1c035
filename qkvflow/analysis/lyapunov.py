"""Token sensitivity by Lyapunov exponents (the paper's eq. 7 and appendix B, Fig. 3).

For a DiffEqFormer dx/dt = F(W(t), x) over the token states x = (x_1..x_n) and a target token j
(the last one, which predicts the next token), the block

    J_ij(t) = d F(W(t), x(t))_j / d x_i        (embed x embed)

tells how a perturbation of input token i moves output token j. For every i the tangent dynamics
dY/dt = J_ij(t) Y, Y(0) = I, are integrated along the trajectory x(t) of the input with Euler steps
on the model's grid t_k = k/N and QR re-orthonormalisation (`qkvflow.analysis.tangent`, T = 1):

    lambda_{i,m} = sum_k log |(R^{(i)}_k)_mm|,        sensitivity_i = max_m lambda_{i,m}

the largest of the log-diagonal sums (not the first column's alone, which depends on which basis
vector happens to come first). The block row J_{j,:} comes from reverse mode: one vector-Jacobian
product per embedding coordinate of token j (`jax.vjp`, vmapped) gives J_ij for every i at once;
the (n embed) x (n embed) Jacobian of the whole sequence is never formed. The model's own solver is
ignored: the trajectory is the Euler solution on the same grid (the model's flow for `euler`).
"""

import json
import os
from dataclasses import dataclass
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from levanter.layers.attention import AttentionMask

from qkvflow.analysis.attention_maps import maps_along
from qkvflow.analysis.tangent import qr_step
from qkvflow.analysis.token_figures import plot_attention_maps, plot_tokens, write_html
from qkvflow.errors import UserError


@dataclass(frozen=True)
class TokenLyapunov:
    """Finite-time Lyapunov exponents of one target token's final state with respect to every input
    token's initial state, with the Euler trajectory they were computed along."""

    exponents: np.ndarray
    """[tokens, embed] lambda_{i,m} for the target token."""
    trajectory: np.ndarray
    """[steps + 1, tokens, embed] Euler states x(t_k), t_k = k / steps."""
    target: int

    @property
    def sensitivity(self) -> np.ndarray:
        """[tokens] max_m lambda_{i,m}."""
        return self.exponents.max(axis=1)

    @property
    def times(self) -> np.ndarray:
        return np.linspace(0.0, 1.0, self.trajectory.shape[0])


def encode_prompt(tokenizer, text: str, max_seq_len: int) -> list[int]:
    """Token ids of `text` without the tokenizer's `<|endoftext|>` wrapping; UserError if unusable.
    `tokenizer`: Levanter's MarinTokenizer or a Hugging Face one (both have `encode(text, add_special_tokens=)`)."""
    if not text.strip():
        raise UserError("lyapunov: --text is empty; give the text whose tokens to analyse")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise UserError(f"lyapunov: --text {text!r} encodes to no tokens")
    if len(ids) > max_seq_len:
        raise UserError(
            f"lyapunov: --text is {len(ids)} tokens long, more than the model's max_seq_len of {max_seq_len}; shorten it"
        )
    return ids


@eqx.filter_jit
def _solve(model, ids: jax.Array, target: int, num_steps: int):
    config = model.config
    n, E = ids.shape[0], config.hidden_dim
    Pos = Axis(config.max_Pos.name, n)
    pos = hax.arange(Pos)
    x0 = model.embed(hax.named(ids, Pos), pos).rearrange((Pos, config.Embed))
    axes, dt, mask = x0.axes, 1.0 / num_steps, AttentionMask.causal()
    eye = jnp.eye(E, dtype=x0.dtype)
    cotangents = jnp.zeros((E, n, E), x0.dtype).at[:, target, :].set(eye)

    def step(carry, k):
        x, q = carry
        weights = model.generator(k * dt)

        def field(y):
            dx = model.field.vector_field(weights, hax.named(y, axes), config=config, mask=mask, pos_ids=pos)
            return dx.rearrange(axes).array

        dx, pullback = jax.vjp(field, x)
        (rows,) = jax.vmap(pullback)(cotangents)  # rows[m, i, e] = dF_{j,m} / dx_{i,e}
        blocks = jnp.swapaxes(rows, 0, 1)  # [i] J_ij
        q, log_r = jax.vmap(qr_step, in_axes=(0, 0, None))(q, blocks @ q, dt)
        return (x + dt * dx, q), (x, log_r)

    q0 = jnp.broadcast_to(eye, (n, E, E))
    (x1, _), (xs, log_r) = jax.lax.scan(step, (x0.array, q0), jnp.arange(num_steps))
    return log_r.sum(axis=0), jnp.concatenate([xs, x1[None]], axis=0)


def token_lyapunov(model, ids, *, target: Optional[int] = None, num_steps: Optional[int] = None) -> TokenLyapunov:
    """Exponents of every input token for output token `target` (default: the last) of `ids` (a 1-D
    sequence of token ids, at most max_seq_len long), with `num_steps` Euler steps (default: the model's)."""
    ids = jnp.asarray(ids, dtype=jnp.int32)
    target = ids.shape[0] - 1 if target is None else target
    num_steps = num_steps or model.config.ode.num_steps
    exponents, trajectory = _solve(model, ids, target, num_steps)
    return TokenLyapunov(np.asarray(exponents), np.asarray(trajectory), target)


def analyze_lyapunov(
    model, tokenizer, text: str, out_dir: str, *, num_steps: Optional[int] = None, num_maps: int = 4
) -> dict:
    """Sensitivities of `text`'s tokens for its last token: HTML page, PNG, attention maps at up to
    `num_maps` grid times, and a JSON summary (written as lyapunov.json and returned)."""
    ids = encode_prompt(tokenizer, text, model.config.max_seq_len)
    if num_steps is not None and num_steps < 1:
        raise UserError(f"lyapunov: --steps {num_steps} is invalid: expected an integer >= 1")
    result = token_lyapunov(model, ids, num_steps=num_steps)
    tokens = [tokenizer.decode([i]) for i in ids]
    steps = result.trajectory.shape[0] - 1
    picked = np.unique(np.linspace(0, steps - 1, min(num_maps, steps)).round().astype(int))
    maps = maps_along(model, result.trajectory[picked], result.times[picked])

    os.makedirs(out_dir, exist_ok=True)
    name = type(model).__name__
    title = f"{name}: Lyapunov exponents for the last token ({steps} Euler steps)"
    sensitivity = result.sensitivity
    summary = {
        "model": name,
        "steps": steps,
        "tokens": tokens,
        "sensitivity": [round(float(s), 6) for s in sensitivity],
        "most_sensitive": tokens[int(np.argmax(sensitivity))],
        "html": write_html(tokens, sensitivity, result.target, os.path.join(out_dir, "lyapunov.html"), title=title),
        "figure": plot_tokens(tokens, sensitivity, result.target, os.path.join(out_dir, "lyapunov.png"), title=title),
        "attention_maps": plot_attention_maps(
            maps, result.times[picked], tokens, os.path.join(out_dir, "attention_maps.png"), title=f"{name}: attention"
        ),
        "json": os.path.join(out_dir, "lyapunov.json"),
    }
    with open(summary["json"], "w") as f:
        json.dump(summary, f, indent=2)
    return summary
