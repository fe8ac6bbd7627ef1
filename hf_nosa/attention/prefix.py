"""Attention over a prefix read in pieces: a prefill chunk that attends to a whole long prompt without holding it.

QUOKA's dense tail (``prefill.PrefillPaths._first_tail_query``) lets the prompt's last ``prefill_dense_tail_tokens``
queries see every earlier token (``DenseTail``): the chunk holding them attends by QUOKA, and then those queries alone
attend again over the whole prefix, their rows of the output replaced (``attend.with_dense_tail``). Before, every
query of that chunk read the whole prefix: at 64K and batch 4, 2048 queries where 64 need it, 30% of the prefill's
attention work (docs/results/2026-12-03_prefill_breakdown_64k_b4_cefa7bb.json).

Read at once, that prefix is a whole layer's K/V on the device for ``B x prompt`` tokens (5 GB at 38 x 64K tokens in
the 1B shape, before the attention's own copies), which would make peak device memory grow with the prompt. Here it
is read ``piece_tokens`` at a time from the host store; each piece's attention returns its log-sum-exp, and the
pieces and the chunk's own causal part are merged as flash-decoding merges splits:

    out = sum_i e^(lse_i - m) out_i / sum_i e^(lse_i - m),  m = max_i lse_i

which equals one softmax over all keys. Where the Triton kernels run, each piece and the chunk's causal part run
``kernels.prefill.flash_biased``, which returns the log-sum-exp and adds the bias in the kernel (no copies of the keys);
elsewhere sdpa's fused kernels with the eviction bias in extra head dimensions (``attention.dense.bias_columns``),
where a piece precedes every query, so the GQA group is folded into the query rows (no copy of the keys per query
head).

On CUDA the next piece is read on a side stream while the current one is attended to (``read_ahead``): the reads
cross PCIe (a 64K prompt's prefix is about 2 GB per sequence in the 1b shape) and the attention runs on the device,
so each hides the other where they overlap.

``attend.attend`` reads the prefix whole and is the reference (``tests/test_prefix_attention.py``).
"""

from __future__ import annotations

from functools import partial

import torch

from ..kernels.prefill.flash_biased import flash_biased, runs_on_kernel
from ..rules.inputs import DenseTail, Prefix  # noqa: F401  (DenseTail: named here for callers)
from .dense import bias_columns
from .read_ahead import read_ahead


def _fused(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sdpa's fused kernel with its log-sum-exp: ``q/k/v [B, h, T, D']`` (same heads) -> out, lse ``[B, h, Tq]``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]  # the efficient kernel pads its lse rows to a multiple of 32


def attention_with_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                       scale: float, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q . k * scale + bias) . v`` and its log-sum-exp, fp32.

    Args:
        query: ``[B, H, Tq, D]``; keys, values ``[B, Hk, S, D]``; bias ``[B, Hk, S]`` fp32.
        causal: query ``i`` sees keys ``0 .. i`` (needs ``Tq == S``); otherwise every key.

    Returns:
        ``out [B, H, Tq, D]`` and ``lse [B, H, Tq]``, both fp32.
    """
    B, H, Tq, D = query.shape
    Hk, S = keys.shape[1], keys.shape[2]
    G = H // Hk
    if causal and Tq != S:
        raise ValueError(f"attention_with_lse: a causal call needs as many queries as keys; got {Tq} and {S}")
    if runs_on_kernel(query, "the dense tail's attention"):
        lse = query.new_empty(B, H, Tq, dtype=torch.float32)
        out = flash_biased(query, keys.to(query.dtype), values.to(query.dtype), bias.float(), scale, causal=causal,
                           lse=lse)
        return out.float(), lse
    q2, k2, v2 = bias_columns(query, keys.to(query.dtype), values.to(query.dtype), bias, scale)
    width = q2.shape[-1]
    if causal:
        if G > 1:
            k2, v2 = k2.repeat_interleave(G, 1), v2.repeat_interleave(G, 1)
        out, lse = _fused(q2, k2, v2, True, scale)
    else:  # every row sees every key: the group's rows share one call per KV head
        out, lse = _fused(q2.reshape(B, Hk, G * Tq, width), k2, v2, False, scale)
        out, lse = out.reshape(B, H, Tq, width), lse.reshape(B, H, Tq)
    return out[..., :D].float(), lse.float()


def attend_with_prefix(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                       prefix: Prefix, scale: float, *, first_query: int = 0) -> torch.Tensor:
    """The chunk's queries over the prefix (read in pieces, all visible) and then over its own keys (causal).

    Args:
        query: ``[B, H, Tq, D]`` the chunk's queries from ``first_query`` on; keys, values ``[B, Hk, T, D]``, bias
            ``[B, Hk, T]``: the chunk's own keys (``T = first_query + Tq``), which follow the prefix.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype.
    """
    q0 = first_query
    if keys.shape[2] != q0 + query.shape[2]:
        raise ValueError(f"attend_with_prefix: {keys.shape[2]} keys for queries {q0} .. {q0 + query.shape[2] - 1}")
    out, lse = attention_with_lse(query, keys[:, :, q0:], values[:, :, q0:], bias[:, :, q0:], scale, causal=True)
    spans = [(lo, min(prefix.length, lo + prefix.piece_tokens)) for lo in range(0, prefix.length, prefix.piece_tokens)]
    reads = [partial(prefix.read, lo, hi) for lo, hi in spans]
    if q0:  # the chunk's keys before the first query: one more piece every query sees
        reads.append(lambda: (keys[:, :, :q0], values[:, :, :q0], bias[:, :, :q0]))
    for k, v, b in read_ahead(reads, query.device):
        piece_out, piece_lse = attention_with_lse(query, k, v, b, scale, causal=False)
        # Merged in place: out and piece_out are [B, H, Tq, D] fp32 each, and a merge written out would hold three
        # more of them at once.
        m = torch.maximum(lse, piece_lse)
        w, piece_w = (lse - m).exp_(), (piece_lse - m).exp_()
        total = w + piece_w
        out.mul_((w / total)[..., None]).add_(piece_out.mul_((piece_w / total)[..., None]))
        lse = m.add_(total.log_())
    return out.to(query.dtype)
