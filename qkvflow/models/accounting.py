"""Parameter and FLOP accounting from shapes alone (`jax.eval_shape`: nothing is allocated).

Forward FLOPs per token count one vector-field evaluation as one transformer layer (Levanter's
`lm_flops_per_token`, matmuls and attention) times the evaluations a solve makes, plus the LM head.
The hypernetwork runs once per evaluation time for the whole batch, not per token, so it is
reported separately per forward pass.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis
from levanter.utils.flop_utils import lm_flops_per_token

from qkvflow.integrate.solve import build_solver
from qkvflow.integrate.solvers import evaluations
from qkvflow.integrate.weight_source import evaluation_times
from qkvflow.models.registry import is_ode


def model_shapes(config, vocab_size: int):
    """The model as a pytree of `jax.ShapeDtypeStruct`s."""
    return jax.eval_shape(lambda: config.build(Axis("vocab", vocab_size), key=jrandom.PRNGKey(0)))


def _is_parameter(x) -> bool:
    """Floating-point arrays (or their shapes); flags such as `inference` booleans are not parameters."""
    is_array = isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)
    return is_array and jnp.issubdtype(x.dtype, jnp.inexact)


def count(tree) -> int:
    leaves = jax.tree_util.tree_leaves(eqx.filter(tree, _is_parameter))
    return sum(math.prod(leaf.shape) for leaf in leaves)


def parameter_counts(config, vocab_size: int) -> dict[str, int]:
    model = model_shapes(config, vocab_size)
    embedding = count((model.token_embeddings, model.position_embeddings, model.lm_head))
    generator = count(model.generator)
    return {
        "total_params": count(model),
        "hypernetwork_params": generator,
        "embedding_params": embedding,
    }


def nominal_evaluations(config) -> int:
    """Vector-field evaluations of a solve: exact for fixed steps; for adaptive solvers, the count
    at `num_steps` accepted steps (the real number depends on the input)."""
    return int(evaluations(build_solver(config.ode), config.ode.num_steps))


def forward_flops_per_token(config, vocab_size: int, context_length: int | None = None) -> float:
    """Per-token forward FLOPs at `context_length` tokens of context (default: the config's max_seq_len);
    attention's share grows with it, as in Levanter's `LmConfig.flops_per_token(vocab, context_length)`."""
    return lm_flops_per_token(
        hidden_dim=config.hidden_dim,
        intermediate_dim=config.mlp_dim,
        num_layers=nominal_evaluations(config),
        num_kv_heads=config.num_heads,
        num_heads=config.num_heads,
        seq_len=config.max_seq_len if context_length is None else context_length,
        vocab_size=vocab_size,
        glu=config.flavour_spec.gated_mlp,
    )


def hypernetwork_flops_per_forward(config, vocab_size: int) -> float:
    """2 x (multiply-adds of one generator call) x (evaluation times of a solve)."""
    model = model_shapes(config, vocab_size)
    times = evaluation_times(config.ode)
    n_times = len(times) if times is not None else nominal_evaluations(config)
    return 2.0 * count(model.generator) * n_times


def train_flops_per_token(config, vocab: int, tokens_per_batch: int) -> dict:
    """Model FLOPs of one training step per token, Levanter's convention: 3 x forward (the ODE's forward
    includes its hypernetwork's share; no rematerialisation).
    Attention's FLOPs are at the full context (`max_seq_len`), as every benchmark step uses it."""
    forward = float(config.flops_per_token(vocab, config.max_seq_len))
    hyper = 0.0
    if is_ode(config):
        hyper = hypernetwork_flops_per_forward(config, vocab) / tokens_per_batch
    return {
        "forward_per_token": forward,
        "hypernetwork_forward_per_token": hyper,
        "train_per_token": 3.0 * (forward + hyper),
    }
