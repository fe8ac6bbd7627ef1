"""The query-aware part of training's selection for many queries: per query token and KV head, the softmax over the
complete compressed-key windows summed over the GQA group (the first stage of ``selection.query_block_scores``).

One program per (sequence, KV head, tile of query tokens). Pass 1 runs an online softmax over the windows for each
head of the group and keeps its row max and sum in a small scratch buffer; pass 2 recomputes the logits tile by
tile and writes the group's summed probabilities once. The torch reference materialises the logits of every head
(``[B, Hk, G, Tq, W]`` fp32) and reads them several times; the kernel writes only ``[B, Hk, Tq, W]``. Pooling the
windows to blocks and choosing the blocks stay in torch (``selection.pool_windows_to_blocks``, ``select_blocks``).
"""

from __future__ import annotations

import torch

from .backend import HAS_TRITON, interpreting, kernel_path, launcher, next_power_of_2, on_device, tl, triton

if HAS_TRITON:

    @triton.jit
    def _head_queries(q_ptr, i_b, head, o_t, o_d, m_t, m_d, stride_qb, stride_qh, stride_qt, IEEE: tl.constexpr):
        """``[BLOCK_T, BLOCK_D]`` queries of one head of the group (fp32 when IEEE)."""
        p_q = q_ptr + i_b.to(tl.int64) * stride_qb + head * stride_qh + o_t[:, None] * stride_qt + o_d[None, :]
        b_q = tl.load(p_q, mask=m_t[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            b_q = b_q.to(tl.float32)
        return b_q

    @triton.jit
    def _window_tile(p_k0, pad_ptr, i_b, i_h, o_w, b_n, o_d, m_d, W, stride_kw, stride_pb, stride_ph,
                     HAS_PAD: tl.constexpr, IEEE: tl.constexpr):
        """Compressed keys ``[BLOCK_W, BLOCK_D]`` of windows ``o_w`` and which (query, window) pairs count: complete
        for that query (``< b_n``) and not padding."""
        m_w = o_w < W
        b_k = tl.load(p_k0 + o_w[:, None] * stride_kw + o_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            b_k = b_k.to(tl.float32)
        ok = m_w[None, :] & (o_w[None, :] < b_n[:, None])
        if HAS_PAD:
            pad = tl.load(pad_ptr + i_b * stride_pb + i_h * stride_ph + o_w, mask=m_w, other=1)
            ok = ok & (pad[None, :] == 0)
        return b_k, ok

    @triton.jit
    def _logits(b_q, b_k, scale, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale
        return tl.dot(b_q, tl.trans(b_k)) * scale

    @triton.jit
    def _window_probs_kernel(
        q_ptr, k_ptr, pad_ptr, n_ptr, out_ptr, m_ptr, l_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kw, stride_pb, stride_ph,
        stride_ob, stride_oh, stride_ot, stride_mb, stride_mh, stride_nb,
        Tq, W, scale,
        HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HAS_PAD: tl.constexpr, IEEE: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_t = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
        o_d = tl.arange(0, BLOCK_D)
        m_t = o_t < Tq
        m_d = o_d < D
        b_n = tl.load(n_ptr + i_b * stride_nb + o_t, mask=m_t, other=0)  # complete windows per query (non-decreasing)
        w_hi = tl.max(b_n, axis=0)
        p_k0 = k_ptr + i_b.to(tl.int64) * stride_kb + i_h * stride_kh

        # Pass 1: row max and sum of each head of the group.
        for g in range(G):
            b_q = _head_queries(q_ptr, i_b, i_h * G + g, o_t, o_d, m_t, m_d, stride_qb, stride_qh, stride_qt, IEEE)
            b_m = tl.full([BLOCK_T], float("-inf"), tl.float32)
            b_l = tl.zeros([BLOCK_T], tl.float32)
            for w0 in range(0, w_hi, BLOCK_W):
                o_w = w0 + tl.arange(0, BLOCK_W)
                b_k, ok = _window_tile(p_k0, pad_ptr, i_b, i_h, o_w, b_n, o_d, m_d, W, stride_kw, stride_pb,
                                       stride_ph, HAS_PAD, IEEE)
                b_s = tl.where(ok, _logits(b_q, b_k, scale, IEEE), float("-inf"))
                m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_l = b_l * tl.exp(b_m - m_use) + tl.sum(tl.exp(b_s - m_use[:, None]), axis=1)
                b_m = m_new
            p_ml = i_b * stride_mb + (i_h * G + g) * stride_mh + o_t
            tl.store(m_ptr + p_ml, b_m, mask=m_t)
            tl.store(l_ptr + p_ml, b_l, mask=m_t)

        # Pass 2: the group's summed probabilities, written once (zeros past the complete windows).
        for w0 in range(0, W, BLOCK_W):
            o_w = w0 + tl.arange(0, BLOCK_W)
            m_w = o_w < W
            b_acc = tl.zeros([BLOCK_T, BLOCK_W], tl.float32)
            if w0 < w_hi:
                b_k, ok = _window_tile(p_k0, pad_ptr, i_b, i_h, o_w, b_n, o_d, m_d, W, stride_kw, stride_pb,
                                       stride_ph, HAS_PAD, IEEE)
                for g in range(G):
                    b_q = _head_queries(q_ptr, i_b, i_h * G + g, o_t, o_d, m_t, m_d, stride_qb, stride_qh,
                                        stride_qt, IEEE)
                    b_s = _logits(b_q, b_k, scale, IEEE)
                    p_ml = i_b * stride_mb + (i_h * G + g) * stride_mh + o_t
                    b_m = tl.load(m_ptr + p_ml, mask=m_t, other=0.0)
                    b_l = tl.load(l_ptr + p_ml, mask=m_t, other=1.0)
                    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
                    b_p = tl.exp(tl.where(ok, b_s, float("-inf")) - b_m[:, None]) / tl.where(b_l > 0, b_l, 1.0)[:, None]
                    b_acc += b_p
            p_o = (out_ptr + i_b.to(tl.int64) * stride_ob + i_h * stride_oh + o_t[:, None].to(tl.int64) * stride_ot
                   + o_w[None, :])
            tl.store(p_o, b_acc, mask=m_t[:, None] & m_w[None, :])


def _launch(query, compressed_keys, n_windows, padding, scale):
    B, H, Tq, D = query.shape
    Hk, W = compressed_keys.shape[1], compressed_keys.shape[2]
    out = torch.empty(B, Hk, Tq, W, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    query = query.contiguous()
    compressed_keys = compressed_keys.to(query.dtype).contiguous()
    n_windows = n_windows.to(device=query.device, dtype=torch.int32).contiguous()
    m = torch.empty(B, H, Tq, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    has_pad = padding is not None
    pad = padding.to(torch.int8).contiguous() if has_pad else n_windows  # any tensor: never read without HAS_PAD
    pad_strides = pad.stride()[:2] if has_pad else (0, 0)
    ieee = interpreting() or query.dtype == torch.float32
    block_t = 16 if interpreting() else 64
    block_w = 16 if interpreting() else 64
    grid = (B * Hk, triton.cdiv(Tq, block_t))
    with on_device(query):
        launcher(_window_probs_kernel)[grid](
            query, compressed_keys, pad, n_windows, out, m, l,
            query.stride(0), query.stride(1), query.stride(2),
            compressed_keys.stride(0), compressed_keys.stride(1), compressed_keys.stride(2),
            *pad_strides, out.stride(0), out.stride(1), out.stride(2), m.stride(0), m.stride(1),
            n_windows.stride(0) if n_windows.dim() == 2 else 0,
            Tq, W, scale,
            HK=Hk, G=H // Hk, D=D, BLOCK_D=max(16, next_power_of_2(D)), BLOCK_T=block_t, BLOCK_W=block_w,
            HAS_PAD=has_pad, IEEE=ieee,
        )
    return out


def window_probs_ref(query, compressed_keys, n_windows, padding, scale) -> torch.Tensor:
    """The torch reference: the first stage of ``selection.query_block_scores``, op for op."""
    B, H, Tq, D = query.shape
    Hk, W = compressed_keys.shape[1], compressed_keys.shape[2]
    q = query.float().view(B, Hk, H // Hk, Tq, D)
    logits = torch.einsum("bkgtd,bkwd->bkgtw", q, compressed_keys.float()) * scale
    available = torch.arange(W, device=query.device) < n_windows.to(query.device)[..., None]  # [(B,) Tq, W]
    if available.dim() == 3:
        available = available[:, None, None]
    logits = logits.masked_fill(~available, float("-inf"))
    if padding is not None:
        logits = logits.masked_fill(padding[:, :, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)


def window_probs(
    query: torch.Tensor,
    compressed_keys: torch.Tensor,
    n_windows: torch.Tensor,
    scale: float,
    *,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per query token: softmax over its complete windows of ``q . k~ * scale``, summed over the GQA group.

    Args:
        query: ``[B, H, Tq, D]``; compressed_keys: ``[B, Hk, W, D]``.
        n_windows: ``[Tq]`` complete windows at each query token (``selection.windows_available``), non-decreasing;
            or ``[B, Tq]`` per row (row-relative positions of a left-padded batch).
        padding: ``[B, Hk, W]`` bool, True for padding windows (left out of the softmax), or None.

    Returns:
        ``[B, Hk, Tq, W]`` float32 in ``[0, G]``; 0 where a window is not complete or is padding, and on rows with
        no window.

    Example:
        >>> q, ck = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 3, 16)
        >>> window_probs(q, ck, torch.tensor([0, 1, 2, 3, 3]), 0.25).sum(-1)[0, 0]
        tensor([0., 2., 2., 2., 2.])
    """
    if query.dim() != 4 or compressed_keys.dim() != 4 or query.shape[1] % compressed_keys.shape[1]:
        raise ValueError(f"query must be [B, H, Tq, D] and compressed_keys [B, Hk, W, D] with H % Hk == 0; got "
                         f"{tuple(query.shape)} and {tuple(compressed_keys.shape)}")
    if tuple(n_windows.shape) not in ((query.shape[2],), (query.shape[0], query.shape[2])):
        raise ValueError(f"n_windows has shape {tuple(n_windows.shape)}; expected [Tq] = [{query.shape[2]}] or "
                         f"[B, Tq] = [{query.shape[0]}, {query.shape[2]}]")
    if kernel_path("window_probs", query) == "triton":
        return _launch(query, compressed_keys, n_windows, padding, scale)
    return window_probs_ref(query, compressed_keys, n_windows, padding, scale)
