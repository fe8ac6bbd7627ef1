"""The forward every NOSA attention class shares: the stock order, with the eviction head and NOSA attention."""

from __future__ import annotations

import torch

from .attention import nosa_attention


class NosaAttentionMixin:
    """Mixed into a family's attention class; keeps its q_proj/k_proj/v_proj/o_proj (and q_norm/k_norm) names.

    A family sets ``rotary`` (its ``apply_rotary_pos_emb``) and may override ``project``.
    """

    rotary = None

    def project(self, hidden_states: torch.Tensor, hidden_shape: tuple[int, ...]):
        """Queries ``[B, H, T, D]``, keys ``[B, Hk, T, D]`` (before RoPE) and the flat values ``[B, T, Hk * D]``."""
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        return query_states, key_states, self.v_proj(hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states, key_states, value_flat = self.project(hidden_states, hidden_shape)
        value_states = value_flat.view(hidden_shape).transpose(1, 2)  # [B, Hk, T, D]

        cos, sin = position_embeddings
        query_states, key_states = type(self).rotary(query_states, key_states, cos, sin)

        cache = cache if cache is not None else past_key_values  # transformers < 5.2x passes past_key_values
        attn_output = nosa_attention(
            self, query_states, key_states, value_states, value_flat, attention_mask, cache
        )  # [B, H, T, D]

        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), None
