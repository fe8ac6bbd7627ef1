"""NOSA attention for Qwen2 / Qwen2.5: the stock Qwen2Attention (full-attention layers) with an eviction head;
RMSNorm and MLP on fused kernels."""

from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, Qwen2MLP, Qwen2RMSNorm

from ..kernels.layers.rotary import apply_rotary
from .base import NosaAttentionMixin
from .fused import FusedMLPMixin, FusedRMSNormMixin


class NosaQwen2Attention(NosaAttentionMixin, Qwen2Attention):
    rotary = staticmethod(apply_rotary)


class NosaQwen2RMSNorm(FusedRMSNormMixin, Qwen2RMSNorm):
    pass


class NosaQwen2MLP(FusedMLPMixin, Qwen2MLP):
    pass


MODEL_CLASS = Qwen2ForCausalLM
ATTENTION_CLASS = NosaQwen2Attention
FUSED_CLASSES = {Qwen2RMSNorm: NosaQwen2RMSNorm, Qwen2MLP: NosaQwen2MLP}
