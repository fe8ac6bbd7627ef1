"""NOSA attention for Llama: the stock LlamaAttention with an eviction head."""

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, apply_rotary_pos_emb

from .base import NosaAttentionMixin


class NosaLlamaAttention(NosaAttentionMixin, LlamaAttention):
    rotary = staticmethod(apply_rotary_pos_emb)


MODEL_CLASS = LlamaForCausalLM
ATTENTION_CLASS = NosaLlamaAttention
