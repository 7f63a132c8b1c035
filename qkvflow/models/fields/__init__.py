"""Vector fields dx/dt = F(W(t), x): attention and feed-forward side by side, pre-norm.

Each flavour module (named by a `qkvflow.models.flavour.Flavour`'s `field`) exposes `weight_specs(config)` (the named weights one evaluation needs) and
`vector_field(weights, x, *, config, mask, pos_ids, key)` (`key`: residual dropout in training, `dropout`).
"""

from . import gpt2, llama

__all__ = ["gpt2", "llama"]
