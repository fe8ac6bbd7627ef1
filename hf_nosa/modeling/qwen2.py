"""NOSA attention for Qwen2 / Qwen2.5: the stock Qwen2Attention (full-attention layers) with an eviction head."""

from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, apply_rotary_pos_emb

from .base import NosaAttentionMixin


class NosaQwen2Attention(NosaAttentionMixin, Qwen2Attention):
    rotary = staticmethod(apply_rotary_pos_emb)


MODEL_CLASS = Qwen2ForCausalLM
ATTENTION_CLASS = NosaQwen2Attention
