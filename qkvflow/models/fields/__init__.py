"""Vector fields dx/dt = F(W(t), x): attention and feed-forward side by side, pre-norm.

Each flavour module exposes `weight_specs(config)` (the named weights one evaluation needs) and
`vector_field(weights, x, *, config, mask, pos_ids)`.
"""

from . import gpt2, llama

FIELDS = {"gpt2": gpt2, "llama": llama}
