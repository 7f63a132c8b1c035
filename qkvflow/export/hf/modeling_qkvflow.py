"""PyTorch parallel-block transformer: a discretised DiffEqFormer, for `transformers`.

    x_0 = embed_tokens(ids) [+ embed_positions(pos), GPT-2 flavour]
    x_{k+1} = x_k + o_proj(Attn(attn_norm(x_k))) + mlp(mlp_norm(x_k))        (attention and MLP in parallel)
    logits = lm_head(norm(x_L))

Attention: causal softmax(q k^T / sqrt(head_dim)) v per head; the Llama flavour rotates q and k
with half-split rotary embeddings (rotate_half, cos/sin of cat(freqs, freqs)), inv_freq =
1 / (rope_theta^(2i/head_dim) * rope_scaling_factor), as Levanter's DefaultRotaryEmbeddings.
No KV cache: generation recomputes the prefix every step (`use_cache` is ignored).

Self-contained (torch + transformers only): `qkvflow export` copies it, with
configuration_qkvflow.py, into each exported folder for `trust_remote_code=True`.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_qkvflow import QkvflowParallelConfig, QkvflowParallelGpt2Config, QkvflowParallelLlamaConfig


class RmsNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(config: QkvflowParallelConfig) -> nn.Module:
    if config.layer_norm:
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    return RmsNorm(config.hidden_size, config.layer_norm_eps)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(config: QkvflowParallelConfig, position_ids, dtype):
    """cos, sin of shape [batch, 1, seq, head_dim] for half-split rotary embeddings."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    inv_freq = inv_freq / config.rope_scaling_factor
    freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class ParallelAttention(nn.Module):
    def __init__(self, config: QkvflowParallelConfig):
        super().__init__()
        self.config = config
        h, b = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, h, bias=b)
        self.k_proj = nn.Linear(h, h, bias=b)
        self.v_proj = nn.Linear(h, h, bias=b)
        self.o_proj = nn.Linear(h, h, bias=b)

    def forward(self, x, mask, rotary=None):
        batch, seq, _ = x.shape
        heads, d = self.config.num_attention_heads, self.config.head_dim

        def split(t):
            return t.view(batch, seq, heads, d).transpose(1, 2)  # [batch, heads, seq, d]

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if rotary is not None:
            cos, sin = rotary
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        out = torch.matmul(F.softmax(scores.float(), dim=-1).to(v.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * d))


class ParallelMlp(nn.Module):
    """GPT-2 flavour: down_proj(act(up_proj(m))); Llama flavour: down_proj(silu(gate_proj(m)) * up_proj(m))."""

    def __init__(self, config: QkvflowParallelConfig):
        super().__init__()
        h, m, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(h, m, bias=b)
        self.up_proj = nn.Linear(h, m, bias=b)
        self.down_proj = nn.Linear(m, h, bias=b)
        self.act = ACT2FN["silu" if self.gated else config.hidden_act]

    def forward(self, m):
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(m)) * self.up_proj(m))
        return self.down_proj(self.act(self.up_proj(m)))


class ParallelBlock(nn.Module):
    def __init__(self, config: QkvflowParallelConfig):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.self_attn = ParallelAttention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = ParallelMlp(config)

    def forward(self, x, mask, rotary=None):
        return x + self.self_attn(self.attn_norm(x), mask, rotary) + self.mlp(self.mlp_norm(x))


class QkvflowParallelPreTrainedModel(PreTrainedModel):
    config_class = QkvflowParallelConfig
    base_model_prefix = "model"
    _no_split_modules = ["ParallelBlock"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
        elif isinstance(module, (nn.LayerNorm, RmsNorm)):
            module.weight.data.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()


class QkvflowParallelModel(QkvflowParallelPreTrainedModel):
    """Embeddings, blocks and final norm; returns norm(x_L) of shape [batch, seq, hidden]."""

    def __init__(self, config: QkvflowParallelConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.learned_positions:
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(ParallelBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        batch, seq = input_ids.shape
        if position_ids is None:
            if attention_mask is not None:  # left padding: count positions over real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device))[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        x = self.embed_tokens(input_ids)
        rotary = None
        if self.config.learned_positions:
            x = x + self.embed_positions(position_ids)
        else:
            rotary = rotary_cos_sin(self.config, position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, mask, rotary)
        return self.norm(x)


class QkvflowParallelForCausalLM(QkvflowParallelPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: QkvflowParallelConfig):
        super().__init__(config)
        self.model = QkvflowParallelModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        """No cache: every step sees the whole sequence so far."""
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # next-token loss, as transformers' causal LMs compute it
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class QkvflowParallelGpt2ForCausalLM(QkvflowParallelForCausalLM):
    config_class = QkvflowParallelGpt2Config


class QkvflowParallelLlamaForCausalLM(QkvflowParallelForCausalLM):
    config_class = QkvflowParallelLlamaConfig


CAUSAL_LM_CLASSES = {"gpt2": QkvflowParallelGpt2ForCausalLM, "llama": QkvflowParallelLlamaForCausalLM}
