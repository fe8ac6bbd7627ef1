"""NOSA attention for Qwen3: the stock Qwen3Attention (per-head RMSNorm on q and k) with an eviction head."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3ForCausalLM, apply_rotary_pos_emb

from .base import NosaAttentionMixin


class NosaQwen3Attention(NosaAttentionMixin, Qwen3Attention):
    rotary = staticmethod(apply_rotary_pos_emb)

    def project(self, hidden_states, hidden_shape):
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        return query_states, key_states, self.v_proj(hidden_states)


MODEL_CLASS = Qwen3ForCausalLM
ATTENTION_CLASS = NosaQwen3Attention
