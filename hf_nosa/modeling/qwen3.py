"""NOSA attention for Qwen3: the stock Qwen3Attention (per-head RMSNorm on q and k) with an eviction head; RMSNorm
(q_norm and k_norm too) and MLP on fused kernels."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3MLP, Qwen3RMSNorm

from ..kernels.layers.rotary import apply_rotary
from .base import NosaAttentionMixin
from .fused import FusedMLPMixin, FusedRMSNormMixin


class NosaQwen3Attention(NosaAttentionMixin, Qwen3Attention):
    rotary = staticmethod(apply_rotary)

    def project(self, hidden_states, hidden_shape):
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        return query_states, key_states, self.v_proj(hidden_states)


class NosaQwen3RMSNorm(FusedRMSNormMixin, Qwen3RMSNorm):
    pass


class NosaQwen3MLP(FusedMLPMixin, Qwen3MLP):
    pass


MODEL_CLASS = Qwen3ForCausalLM
ATTENTION_CLASS = NosaQwen3Attention
FUSED_CLASSES = {Qwen3RMSNorm: NosaQwen3RMSNorm, Qwen3MLP: NosaQwen3MLP}
