"""Chunk attention of the QUOKA prefill: each chunk's queries attend to a list of key rows, with a per-key bias.

``index [B, Hk, R, S]`` lists, per (sequence, KV head) and chunk, the rows of ``keys``/``values`` the chunk may
read (its selected blocks and its own tokens; -1 for none), so the keys are read in place, never gathered into a
copy. Query row t of chunk r sees key row k when ``0 <= k <= t + shift[r]`` (causal; for the selected blocks,
which precede the chunk, always). One program serves a tile of query rows for all G query heads of a KV head,
so each key is loaded once per KV head; key tiles no query of the tile can see are skipped. bf16/fp16 in, fp32
accumulation; the bias is added after the scaling, as in ``attend``.

Tried and measured slower: a separate loop over the selected blocks without the causal test and the skip branch
(so that its loads could be pipelined) took 2.57 ms against 2.26 ms for one 16-chunk group of a 64K-token layer on
an H200 (1B shape, bf16; about 130 TFLOP/s here against ~445 for cuDNN's dense flash attention;
docs/results/2026-11-30_chunk_attention_split_loop.json).
"""

from __future__ import annotations

import torch

from ...rules.attend import AttentionInputs, attend
from ...rules.selection import MASK_VALUE
from ..backend import HAS_TRITON, interpreting, kernel_path, launcher, next_power_of_2, on_device, tl, triton

if HAS_TRITON:

    @triton.jit(do_not_specialize=["S", "tiles_per_chunk", "stride_bb", "stride_bh"])
    def _chunk_attention_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, index_ptr, rows_ptr, shift_ptr, out_ptr,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_bb, stride_bh, stride_bt,
        stride_ib, stride_ih, stride_ir, stride_is,
        stride_ob, stride_oh, stride_ot, stride_od,
        S, tiles_per_chunk, scale,
        HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
    ):
        i_bh, i_rm = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // HK, i_bh % HK
        i_r, i_m = i_rm // tiles_per_chunk, i_rm % tiles_per_chunk
        row_lo = tl.load(rows_ptr + i_r)
        row_hi = tl.load(rows_ptr + i_r + 1)
        shift = tl.load(shift_ptr + i_r)

        # Rows of the tile: BLOCK_M query rows x G_PAD heads of the group, query row major.
        o_x = tl.arange(0, BLOCK_M * G_PAD)
        o_t = row_lo + i_m * BLOCK_M + o_x // G_PAD
        o_g = o_x % G_PAD
        m_x = (o_t < row_hi) & (o_g < G)
        o_d = tl.arange(0, D_PAD)
        m_d = o_d < D
        p_q = (q_ptr + i_b.to(tl.int64) * stride_qb + (i_h * G + o_g)[:, None] * stride_qh
               + o_t[:, None].to(tl.int64) * stride_qt + o_d[None, :] * stride_qd)
        b_q = tl.load(p_q, mask=m_x[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            b_q = b_q.to(tl.float32)
        limit = o_t + shift  # key rows each query row may see
        last = tl.minimum(row_hi, row_lo + (i_m + 1) * BLOCK_M) - 1 + shift  # the most any row of the tile sees
        n_keys = tl.where(row_lo + i_m * BLOCK_M < row_hi, S, 0)  # an empty tile reads nothing

        p_i = index_ptr + i_b.to(tl.int64) * stride_ib + i_h * stride_ih + i_r * stride_ir
        p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_h * stride_kh
        p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_h * stride_vh
        p_bias = bias_ptr + i_b.to(tl.int64) * stride_bb + i_h * stride_bh
        b_m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M * G_PAD], tl.float32)
        b_acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
        for s0 in range(0, n_keys, BLOCK_N):
            o_s = s0 + tl.arange(0, BLOCK_N)
            b_idx = tl.load(p_i + o_s * stride_is, mask=o_s < S, other=-1)
            m_s = b_idx >= 0
            if tl.max(tl.where(m_s & (b_idx <= last), 1, 0), 0) > 0:
                o_k = b_idx.to(tl.int64)
                m_kv = m_s[:, None] & m_d[None, :]
                b_k = tl.load(p_k + o_k[:, None] * stride_kt + o_d[None, :] * stride_kd, mask=m_kv, other=0.0)
                b_bias = tl.load(p_bias + o_k * stride_bt, mask=m_s, other=0.0)
                if IEEE:
                    b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")
                else:
                    b_s = tl.dot(b_q, tl.trans(b_k))
                b_s = b_s * scale + b_bias[None, :]
                visible = m_s[None, :] & (b_idx[None, :] <= limit[:, None])
                # Finite, like attend's masks: a row that sees nothing stays finite instead of NaN.
                b_s = tl.where(visible, b_s, MASKED)
                m_new = tl.maximum(b_m, tl.max(b_s, 1))
                alpha = tl.exp(b_m - m_new)
                b_p = tl.exp(b_s - m_new[:, None])
                b_l = b_l * alpha + tl.sum(b_p, 1)
                b_v = tl.load(p_v + o_k[:, None] * stride_vt + o_d[None, :] * stride_vd, mask=m_kv, other=0.0)
                if IEEE:
                    b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
                else:
                    b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
                b_acc = b_acc * alpha[:, None] + b_pv
                b_m = m_new

        b_o = b_acc / tl.maximum(b_l, 1e-30)[:, None]
        p_o = (out_ptr + i_b.to(tl.int64) * stride_ob + (i_h * G + o_g)[:, None] * stride_oh
               + o_t[:, None].to(tl.int64) * stride_ot + o_d[None, :] * stride_od)
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_x[:, None] & m_d[None, :])


_DEVICE_INTS: dict[tuple, torch.Tensor] = {}


def _device_ints(values: list[int], device) -> torch.Tensor:
    """``values`` as an int32 device tensor, built once per distinct list: a copy from pageable host memory would
    wait for the whole stream on every launch."""
    key = (tuple(values), str(device))
    found = _DEVICE_INTS.get(key)
    if found is None:
        if len(_DEVICE_INTS) > 4096:
            _DEVICE_INTS.clear()
        found = _DEVICE_INTS[key] = torch.tensor(values, dtype=torch.int32).to(device)
    return found


def _launch(query, keys, values, key_bias, index, rows, shift, scale, out, rows_per_tile):
    B, H, _, D = query.shape
    Hk, R, S = keys.shape[1], index.shape[2], index.shape[3]
    G = H // Hk
    G_PAD = next_power_of_2(G)
    block_m = max(1, rows_per_tile // G_PAD)
    longest = max(rows[r + 1] - rows[r] for r in range(R))
    tiles = max(1, -(-longest // block_m))
    device = query.device
    rows_t, shift_t = _device_ints(rows, device), _device_ints(shift, device)
    interpreted = interpreting()
    # fp32 keeps full precision; the interpreter computes tl.dot on bf16 wrongly, so it casts too.
    ieee = query.dtype == torch.float32 or keys.dtype == torch.float32 or interpreted
    with on_device(query):
        launcher(_chunk_attention_kernel)[(B * Hk, R * tiles)](
            query, keys, values, key_bias, index, rows_t, shift_t, out,
            *query.stride(), *keys.stride(), *values.stride(), *key_bias.stride(), *index.stride(), *out.stride(),
            S, tiles, float(scale),
            HK=Hk, G=G, G_PAD=G_PAD, D=D, D_PAD=max(16, next_power_of_2(D)),
            BLOCK_M=block_m, BLOCK_N=16 if interpreted else 64, IEEE=ieee, MASKED=MASK_VALUE,
            num_warps=8 if block_m * G_PAD >= 128 else 4, num_stages=2,
        )


def chunk_attention_ref(query, keys, values, key_bias, index, rows, shift, scale, out) -> None:
    """Torch reference: per chunk, gather the listed key rows and run ``attend`` with the causal rule as a mask."""
    B, Hk = keys.shape[:2]
    device = query.device
    bi = torch.arange(B, device=device)[:, None, None]
    hi = torch.arange(Hk, device=device)[None, :, None]
    for r in range(index.shape[2]):
        a, z = rows[r], rows[r + 1]
        if z <= a:
            continue
        idx = index[:, :, r].long()  # [B, Hk, S]
        safe = idx.clamp(min=0)
        t = torch.arange(a, z, device=device) + shift[r]
        visible = (idx[:, :, None, :] >= 0) & (idx[:, :, None, :] <= t[:, None])  # [B, Hk, Tc, S]
        inputs = AttentionInputs(
            keys[bi, hi, safe], values[bi, hi, safe], key_bias[bi, hi, safe].float(),
            torch.where(visible, 0.0, MASK_VALUE), 0, causal=False,
        )
        out[:, :, a:z] = attend(query[:, :, a:z], inputs, scale)


def chunk_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_bias: torch.Tensor,
    index: torch.Tensor,
    rows: list[int],
    shift: list[int],
    scale: float,
    *,
    out: torch.Tensor | None = None,
    rows_per_tile: int = 128,
) -> torch.Tensor:
    """``softmax(q . k * scale + bias) . v`` of R chunks over listed key rows: Triton on CUDA, torch elsewhere
    (``HF_NOSA_KERNELS=torch|triton`` forces one, see ``backend.py``).

    Args:
        query: ``[B, H, Tq, D]``; chunk r's queries are the rows ``rows[r] .. rows[r + 1] - 1``.
        keys, values: ``[B, Hk, Tk, D]``; key_bias: ``[B, Hk, Tk]`` float32 (eviction score, ``MASK_VALUE`` for
            padding).
        index: ``[B, Hk, R, S]`` integer key rows per chunk, -1 for none.
        rows: R + 1 increasing query-row offsets; shift: R integers, query row t of chunk r sees key rows
            ``0 .. t + shift[r]`` among those listed.
        out: ``[B, H, Tq, D]`` to write the chunks' rows into (default: a new zero tensor).

    Returns:
        ``out``, in the query's dtype.

    Example:
        >>> q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
        >>> index = torch.arange(6).expand(1, 2, 1, 6)
        >>> chunk_attention(q, k, k, torch.zeros(1, 2, 6), index, [0, 6], [0], 0.25).shape
        torch.Size([1, 4, 6, 16])
    """
    B, H, Tq, D = query.shape
    if keys.dim() != 4 or keys.shape[0] != B or keys.shape[3] != D or H % max(keys.shape[1], 1):
        raise ValueError(f"chunk_attention: keys must be [B, Hk, Tk, D] with H % Hk == 0; got {tuple(keys.shape)}")
    if values.shape != keys.shape or key_bias.shape != keys.shape[:3]:
        raise ValueError(
            f"chunk_attention: values {tuple(values.shape)} and key_bias {tuple(key_bias.shape)} must match keys "
            f"{tuple(keys.shape)}"
        )
    R = index.shape[2] if index.dim() == 4 else -1
    if index.dim() != 4 or index.shape[:2] != keys.shape[:2] or len(rows) != R + 1 or len(shift) != R:
        raise ValueError(
            f"chunk_attention: index must be [B, Hk, R, S] with R + 1 rows and R shifts; got index "
            f"{tuple(index.shape)}, {len(rows)} rows, {len(shift)} shifts"
        )
    if any(b < a for a, b in zip(rows, rows[1:])) or rows[0] < 0 or rows[-1] > Tq:
        raise ValueError(f"chunk_attention: rows must increase within 0 .. {Tq}; got {rows}")
    if out is None:
        out = torch.zeros_like(query)
    if kernel_path("chunk_attention", query) == "torch":
        chunk_attention_ref(query, keys, values, key_bias, index, rows, shift, scale, out)
    else:
        _launch(query, keys, values, key_bias, index, rows, shift, scale, out, rows_per_tile)
    return out
