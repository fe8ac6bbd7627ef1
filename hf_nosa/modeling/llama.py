"""NOSA attention for Llama: the stock LlamaAttention with an eviction head; RMSNorm and MLP on fused kernels."""

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaRMSNorm

from ..kernels.layers.rotary import apply_rotary
from .base import NosaAttentionMixin
from .fused import FusedMLPMixin, FusedRMSNormMixin


class NosaLlamaAttention(NosaAttentionMixin, LlamaAttention):
    rotary = staticmethod(apply_rotary)


class NosaLlamaRMSNorm(FusedRMSNormMixin, LlamaRMSNorm):
    pass


class NosaLlamaMLP(FusedMLPMixin, LlamaMLP):
    pass


MODEL_CLASS = LlamaForCausalLM
ATTENTION_CLASS = NosaLlamaAttention
FUSED_CLASSES = {LlamaRMSNorm: NosaLlamaRMSNorm, LlamaMLP: NosaLlamaMLP}
