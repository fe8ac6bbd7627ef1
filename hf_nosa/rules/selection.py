"""The NOSA selection rules in plain torch: the specification in code.

Every rule is a small function over whole batches; the cache, the training attention and the Triton kernels
are all held against these. Shapes use one alphabet: B batch, H query heads, Hk KV heads, G = H / Hk,
D head dim, T tokens, Tq query tokens, P block size, N blocks, W compressed windows, K budget blocks.

Section numbers refer to hf-nosa's design notes (NOSA paper, Sec. 3: eviction head, compressed keys,
query-aware score, selection, locality).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import NosaConfig

# Large but finite, so that fully masked rows stay finite (as transformers' eager masks do) and sums of a few
# masks cannot overflow fp32.
MASK_VALUE = -1e30

# A padding window is a compressed window that holds at least one padding token. Padding tokens are stored with
# eviction score MASK_VALUE (``masks.padding_bias``), so such a window's mean score is at most about
# MASK_VALUE / compress_kernel, while windows of real tokens average scores of order one. A compressed score
# below this threshold (far from both, for any compress_kernel up to 10**5) marks a padding window. Padding
# windows take no part in query-aware scoring (``query_block_scores``, ``quoka_scores`` and their kernels): pad
# keys mean nothing (with one pad id they are all alike, and mixed windows average them in), so they would take
# softmax mass from the real windows and make near-ties that different code paths break differently. They score
# the bottom of each scale instead (probability 0; ``QUOKA_PADDING_SCORE``), so a block without a real window
# (padding only, or fewer than compress_stride real tokens) ties at the bottom and never outranks a block that has
# one; ties go to the most recent block as always. Left padding itself is not stored by a NosaCache (rows are
# stored from their first real token, ``rules/padding.py``); padding windows come from padding stored where it stands
# (holes in a mask, a prompt that reached the cache without ``modeling.chunked``).
PADDING_WINDOW_BIAS = MASK_VALUE * 1e-6

# The QUOKA score of a padding window: below every real score (an attention mass, >= 0), above "no window" (-inf).
# A block whose windows are all padding stays a candidate (a partly real block must remain reachable with a full
# budget), last.
QUOKA_PADDING_SCORE = -2.0


def eviction_bias(value_flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor):
    """Eviction-head score b[j, h] = A[h] * softplus(delta(v_j))[h] (design Sec. 3.1).

    Args:
        value_flat: ``[B, T, Hk * D]`` value vectors of all KV heads, concatenated (the v_proj output).
        weight, bias: the ``delta`` Linear (Hk * D -> Hk).
        A: ``[Hk]`` per-head scale; zeros make the bias vanish, which is the identity with full attention.

    Returns:
        ``[B, Hk, T]`` float32. A higher score keeps the token's block on the device longer and adds to its
        attention logit.

    The torch rule; the model's eviction heads run ``attention.eviction_bias``, which takes the same values from one
    kernel where no gradient is wanted (``kernels.layers.eviction_bias``).
    """
    return eviction_scores(F.linear(value_flat.to(weight.dtype), weight, bias), A)


def eviction_scores(logits: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``A[h] * softplus(logits[b, t, h])`` in float32, as ``[B, Hk, T]`` (a view of ``[B, T, Hk]``)."""
    # A in its own (half or single) dtype: the product promotes it to float32 on the fly, exactly as A.float()
    # would, with one launch fewer
    scale = A.float() if A.dtype == torch.float64 else A
    return (F.softplus(logits.float()) * scale).transpose(1, 2)


def num_windows(n_tokens: int, cfg: NosaConfig) -> int:
    """Number of full compression windows over the first ``n_tokens`` tokens."""
    if n_tokens < cfg.compress_kernel:
        return 0
    return (n_tokens - cfg.compress_kernel) // cfg.compress_stride + 1


def compress_keys(x: torch.Tensor, cfg: NosaConfig) -> torch.Tensor:
    """Mean over windows of ``compress_kernel`` tokens with stride ``compress_stride``; full windows only (Sec. 3.2).

    Args:
        x: ``[B, Hk, T, D]`` post-RoPE keys, or ``[B, Hk, T]`` eviction scores.

    Returns:
        ``[B, Hk, W, D]`` (or ``[B, Hk, W]``) with ``W = num_windows(T)``.
    """
    squeeze = x.dim() == 3
    if squeeze:
        x = x.unsqueeze(-1)
    w = num_windows(x.shape[2], cfg)
    if w == 0:
        out = x.new_zeros(*x.shape[:2], 0, x.shape[-1])
    else:
        windows = x.unfold(2, cfg.compress_kernel, cfg.compress_stride)  # [B, Hk, W, D, kernel]
        out = windows.float().mean(-1).to(x.dtype)
    return out.squeeze(-1) if squeeze else out


def window_offsets(cfg: NosaConfig, device=None) -> tuple[int, torch.Tensor]:
    """Windows overlapping block b are ``b * P / stride + offsets`` (for P=64, kernel 32, stride 16: 4b-1 .. 4b+3)."""
    s = cfg.compress_stride
    first = -(cfg.compress_kernel // s) + 1
    last = cfg.block_size // s - 1
    return cfg.block_size // s, torch.arange(first, last + 1, device=device)


def pool_windows_to_blocks(window_scores: torch.Tensor, n_blocks: int, cfg: NosaConfig, fill: float) -> torch.Tensor:
    """Per block, the max over the windows that overlap it (Sec. 3.3, second pooling stage).

    Args:
        window_scores: ``[..., W]``; windows that do not exist yet must already hold ``fill``.
        fill: value for blocks' missing windows (0 for probabilities, -inf for eviction scores).

    Returns:
        ``[..., N]``.
    """
    per_block, offsets = window_offsets(cfg, window_scores.device)
    W = window_scores.shape[-1]
    index = torch.arange(n_blocks, device=window_scores.device)[:, None] * per_block + offsets  # [N, m]
    outside = (index < 0) | (index >= W)
    padded = F.pad(window_scores, (0, 1), value=fill)  # column W holds `fill`
    index = torch.where(outside, torch.full_like(index, W), index)
    gathered = padded[..., index.flatten()].unflatten(-1, index.shape)  # [..., N, m]
    return gathered.amax(-1)


def windows_available(positions: torch.Tensor, cfg: NosaConfig) -> torch.Tensor:
    """For query tokens at ``positions`` ([Tq]), how many windows are complete: ``[Tq]`` long."""
    n = (positions + 1 - cfg.compress_kernel).div(cfg.compress_stride, rounding_mode="floor") + 1
    return n.clamp(min=0)


def windows_before(start: int, cfg: NosaConfig) -> int:
    """``windows_available`` of the token before ``start``, on the host: the windows complete before it."""
    return max(0, (start - cfg.compress_kernel) // cfg.compress_stride + 1)


def _rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A mask over query tokens, ``[Tq, ...]`` (shared by the rows) or ``[B, Tq, ...]`` (per row), made to broadcast
    against ``[B, <heads dims>, Tq, ...]``: a per-row mask gets ``heads`` singleton dims after B."""
    return x if x.dim() == 2 else x.view(x.shape[0], *([1] * heads), *x.shape[1:])


def _padding_windows(compressed_bias: torch.Tensor, shape, caller: str) -> torch.Tensor:
    """``[B, Hk, W]`` bool, True for padding windows (``PADDING_WINDOW_BIAS``); ``shape`` is the expected one."""
    if tuple(compressed_bias.shape) != tuple(shape):
        raise ValueError(
            f"{caller}: compressed_bias must be [B, Hk, W] = {tuple(shape)}, like the compressed keys; "
            f"got {tuple(compressed_bias.shape)}"
        )
    return compressed_bias.float() < PADDING_WINDOW_BIAS


def query_block_scores(
    query: torch.Tensor,
    compressed_keys: torch.Tensor,
    positions: torch.Tensor,
    n_blocks: int,
    cfg: NosaConfig,
    scale: float,
    *,
    compressed_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query-aware block score (Sec. 3.3).

    Per query head, softmax over the complete windows of ``q . k~ * scale``; summed over the heads of each GQA
    group; per block, max over the windows that overlap it. Higher means the query attends more to the block.

    Padding windows (see ``PADDING_WINDOW_BIAS``: a window holding any padding token of a left-padded batch) are
    left out of the softmax: they get probability 0 and take nothing from the real windows, so a padded row's
    real blocks score as they would without the padding. Blocks without a real window score 0.

    Args:
        query: ``[B, H, Tq, D]``.
        compressed_keys: ``[B, Hk, W, D]``.
        positions: ``[Tq]`` index of each query token (windows complete at that token are used), or ``[B, Tq]``
            per row (row-relative indices of a left-padded batch, see ``hf_nosa.rules.padding``).
        compressed_bias: ``[B, Hk, W]`` window means of the eviction scores (padding folded in), which mark the
            padding windows; None when the batch has no padding.

    Returns:
        ``[B, Hk, Tq, N]`` float32, in ``[0, G]``.
    """
    B, H, Tq, D = query.shape
    Hk, W = compressed_keys.shape[1], compressed_keys.shape[2]
    G = H // Hk
    q = query.float().view(B, Hk, G, Tq, D)
    logits = torch.einsum("bkgtd,bkwd->bkgtw", q, compressed_keys.float()) * scale  # [B, Hk, G, Tq, W]
    available = _rows(torch.arange(W, device=query.device) < windows_available(positions, cfg)[..., None], 2)
    logits = logits.masked_fill(~available, float("-inf"))
    if compressed_bias is not None:
        padding = _padding_windows(compressed_bias, compressed_keys.shape[:3], "query_block_scores")  # [B, Hk, W]
        logits = logits.masked_fill(padding[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # [B, Hk, Tq, W]
    return pool_windows_to_blocks(probs, n_blocks, cfg, fill=0.0)


def eviction_block_scores(
    compressed_bias: torch.Tensor, positions: torch.Tensor, n_blocks: int, cfg: NosaConfig
) -> torch.Tensor:
    """Query-agnostic block score from the eviction head (Sec. 3.4): max over overlapping windows of the mean b.

    Args:
        compressed_bias: ``[B, Hk, W]`` window means of b.
        positions: ``[Tq]``, or ``[B, Tq]`` per row.

    Returns:
        ``[B, Hk, Tq, N]`` float32; higher means the block is kept.
    """
    W = compressed_bias.shape[-1]
    available = _rows(torch.arange(W, device=compressed_bias.device) < windows_available(positions, cfg)[..., None], 1)
    scores = compressed_bias.float()[:, :, None, :].masked_fill(~available, float("-inf"))  # [B, Hk, Tq, W]
    return pool_windows_to_blocks(scores, n_blocks, cfg, fill=float("-inf"))


def favour_resident(query_scores: torch.Tensor, resident: torch.Tensor, margin: float) -> torch.Tensor:
    """Query-aware block scores with the blocks the device holds multiplied by ``1 + margin`` (``resident_margin``).

    A decode step's query-aware choice then changes only where a new block beats a held one by that factor, so
    consecutive steps share more blocks. Multiplying (not adding) keeps the order among new blocks and among held
    ones, and a block the query ignores (score 0) gains nothing.

    Args:
        query_scores: ``[B, Hk, Tq, N]``.
        resident: ``[B, Hk, S]`` long, the blocks held (the slot pool's table: last step's selection and the
            block being written), -1 for an empty slot.

    Returns:
        ``[B, Hk, Tq, N]`` float32.
    """
    N = query_scores.shape[-1]
    held = torch.zeros(*resident.shape[:2], N + 1, dtype=torch.bool, device=query_scores.device)
    held.scatter_(-1, torch.where((resident < 0) | (resident >= N), N, resident).to(query_scores.device), True)
    return torch.where(held[:, :, None, :N], query_scores.float() * (1.0 + margin), query_scores.float())


def topk_recent_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores on the last dim, ties broken towards the most recent (highest) index.

    Entries scored ``-inf`` are never chosen: their slots hold -1. Returns ``[..., k]`` long.
    """
    N = scores.shape[-1]
    if N < k:
        scores = F.pad(scores, (0, k - N), value=float("-inf"))
        N = k
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    top = (N - 1) - order
    chosen = scores.gather(-1, top)
    return torch.where(chosen == float("-inf"), torch.full_like(top, -1), top)


def force_sink_and_local(scores: torch.Tensor, current_block: torch.Tensor, cfg: NosaConfig):
    """Candidate blocks are those before ``current_block``; sink blocks and the local window among them score +inf.

    Args:
        scores: ``[B, Hk, Q, N]`` block scores of Q query tokens (or chunks); current_block: ``[Q]`` long, or
            ``[B, Q]`` per row (row-relative blocks of a left-padded batch).

    Returns:
        (scores with +inf forced and -inf for non-candidates, fp32; ``[Q, N]`` (or ``[B, 1, Q, N]``) bool mask of
        the candidates).
    """
    block = torch.arange(scores.shape[-1], device=scores.device)
    current = _rows(current_block.to(scores.device)[..., None], 1)  # [Q, 1] or [B, 1, Q, 1]
    valid = block < current
    forced = valid & ((block < cfg.sink_blocks) | (block >= current - cfg.local_blocks))
    return scores.float().masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf")), valid


def select_blocks(
    query_scores: torch.Tensor,
    eviction_scores: torch.Tensor,
    current_block: torch.Tensor,
    cfg: NosaConfig,
    budget_blocks: int | None = None,
) -> torch.Tensor:
    """NOSA block selection (Sec. 3.4).

    Candidates are the complete blocks before ``current_block``. Sink blocks and the local window score +inf;
    ``Q = topk(query score, sink + local + query blocks)``; then the eviction score with +inf on Q picks the
    budget: ``selected = topk(eviction score, K)``. So K - |Q| blocks come from the query-agnostic eviction
    head. Ties go to the most recent block.

    Args:
        query_scores, eviction_scores: ``[B, Hk, Tq, N]``.
        current_block: ``[Tq]`` long, the block each query token writes into, or ``[B, Tq]`` per row.
        budget_blocks: K, default ``cfg.budget_blocks``.

    Returns:
        ``[B, Hk, Tq, K]`` long block indices, -1 where fewer than K candidates exist.
    """
    K = cfg.budget_blocks if budget_blocks is None else budget_blocks
    N = query_scores.shape[-1]
    qs, valid = force_sink_and_local(query_scores, current_block, cfg)
    inf = float("inf")
    n_q = min(cfg.sink_blocks + cfg.local_blocks + cfg.query_blocks, K)
    query_chosen = topk_recent_first(qs, n_q)  # [B, Hk, Tq, n_q]
    in_q = torch.zeros(*qs.shape[:-1], N + 1, dtype=torch.bool, device=qs.device)
    in_q.scatter_(-1, torch.where(query_chosen < 0, N, query_chosen), True)
    es = eviction_scores.float().masked_fill(in_q[..., :N], inf).masked_fill(~valid, -inf)
    return topk_recent_first(es, K)


def blocks_to_token_mask(selected: torch.Tensor, positions: torch.Tensor, n_tokens: int, cfg: NosaConfig):
    """Token-level attention mask of a selection: the selected blocks plus the current block up to the token.

    Args:
        selected: ``[B, Hk, Tq, K]`` from ``select_blocks``.
        positions: ``[Tq]`` index of each query token, or ``[B, Tq]`` per row.

    Returns:
        ``[B, Hk, Tq, n_tokens]`` bool, True where the query attends.
    """
    P = cfg.block_size
    n_blocks = (n_tokens + P - 1) // P
    block_mask = torch.zeros(*selected.shape[:-1], n_blocks + 1, dtype=torch.bool, device=selected.device)
    block_mask.scatter_(-1, torch.where(selected < 0, n_blocks, selected), True)
    mask = block_mask[..., :n_blocks].repeat_interleave(P, dim=-1)[..., :n_tokens]
    token = torch.arange(n_tokens, device=selected.device)
    pos = positions.to(selected.device)[..., None]
    current = _rows((token // P == pos.div(P, rounding_mode="floor")) & (token <= pos), 1)  # [Tq, T] / [B, 1, Tq, T]
    return mask | current


def nosa_token_mask(
    query: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    q_offset: int,
    cfg: NosaConfig,
    scale: float,
    *,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode rule applied to every query token at once (prefill="nosa", updates after a prompt, training).

    Token ``t = q_offset + i`` sees exactly the blocks that decoding token t would select.

    Args:
        query: ``[B, H, Tq, D]``; keys: ``[B, Hk, T, D]`` with ``T = q_offset + Tq``; bias: ``[B, Hk, T]`` with
            padding folded in (``MASK_VALUE``), so padding windows leave the query-aware score as in decoding.
        offsets: ``[B]`` long, the left padding of each row (``padding.leading_padding``), or None for none.
            Row b's blocks, windows, sink and local window are then counted from its first real token
            ``offsets[b]``, as if the row were alone: the rule runs on the row's tokens moved to the front
            (``padding.to_rows``) and the mask comes back in the keys' layout. A query inside the padding sees
            nothing.

    Returns:
        ``[B, Hk, Tq, T]`` bool.
    """
    T = keys.shape[2]
    Tq = query.shape[2]
    P = cfg.block_size
    positions = torch.arange(q_offset, q_offset + Tq, device=query.device)
    if offsets is not None:
        from .padding import from_rows, to_rows

        offsets = offsets.to(query.device)
        keys, bias = to_rows(keys, offsets), to_rows(bias, offsets, fill=MASK_VALUE)
        positions = positions - offsets[:, None]  # [B, Tq] row-relative; negative inside the padding
    n_blocks = (T + P - 1) // P
    compressed_bias = compress_keys(bias, cfg)
    qs = query_block_scores(
        query, compress_keys(keys, cfg), positions, n_blocks, cfg, scale, compressed_bias=compressed_bias
    )
    es = eviction_block_scores(compressed_bias, positions, n_blocks, cfg)
    selected = select_blocks(qs, es, positions.div(P, rounding_mode="floor"), cfg)
    mask = blocks_to_token_mask(selected, positions, T, cfg)
    return mask if offsets is None else from_rows(mask, offsets)


# ----- QUOKA: query-oriented block selection for chunked prefill (design Sec. 4) -----


def quoka_query_choice(query: torch.Tensor, n_keep: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The queries of a chunk that stand in for it: per query head, the ``n_keep`` least similar to the mean query.

    QUOKA observes that queries far (in angle) from the chunk's mean query attend to more, and more varied, keys;
    scoring blocks against them approximates what the whole chunk attends to.

    Args:
        query: ``[..., T, D]`` the chunk's queries per head (``[B, H, T, D]``, or ``[B, H, R, T, D]`` for R chunks).
        n_keep: N_Q, queries kept per head.
        valid: bool ``[..., T]`` broadcastable to the queries' leading dims, False for padding: padding does not
            enter the mean and is kept only after every real query.

    Returns:
        ``[..., n]`` long token indices, ``n = min(n_keep, T)``, lowest cosine similarity to the mean first.
    """
    q = query.float()
    n = min(n_keep, q.shape[-2])
    if valid is None:
        mean = q.mean(-2, keepdim=True)
    else:
        weight = valid.to(q.dtype)[..., None]
        mean = (q * weight).sum(-2, keepdim=True) / weight.sum(-2, keepdim=True).clamp(min=1)
    # The mean's norm is one positive number per head: it scales the head's cosines alike, so the ranking needs only
    # the dot with the mean over the query's norm (fewer launches than normalising both; the prefill runs this per
    # layer and chunk).
    cosine = (q @ mean.transpose(-1, -2)).squeeze(-1) / torch.linalg.vector_norm(q, dim=-1).clamp_min(1e-12)
    if valid is not None:
        cosine = cosine.masked_fill(~valid, float("inf"))
    return torch.topk(cosine, n, dim=-1, largest=False, sorted=True).indices


def quoka_scores(
    kept_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    n_windows: torch.Tensor,
    n_blocks: int,
    cfg: NosaConfig,
    n_valid: torch.Tensor | None = None,
    *,
    compressed_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """QUOKA block score: the attention mass the kept queries put on each block, estimated on the compressed keys.

    For each kept query of each query head: softmax over the complete windows of ``q . k~ / sqrt(D)`` (the decode
    rule's query-aware score, ``query_block_scores``); summed over the heads of the GQA group; averaged over the kept
    queries; per block, the max over the windows that overlap it (as ``pool_windows_to_blocks``). Higher means the
    chunk's queries attend more to the block. QUOKA's cosine similarity (normalised queries averaged over the group,
    max over kept queries) found a pass key's block far less often on SmolLM2 (``experiments/quoka_passkey.py``):
    the norms and the softmax are what make a few sharp retrieval heads stand out from heads that look everywhere.

    Padding windows (``PADDING_WINDOW_BIAS``: a window holding any padding token) take no part in the softmax and
    score ``QUOKA_PADDING_SCORE``, below every real score: pad keys mean nothing (with one pad id they are all
    alike), so scored they would only take mass and make near-ties between blocks of padding. A block without a
    real window thus ties at the bottom (ties go to the most recent block).

    Args:
        kept_queries: ``[B, H, R, n, D]`` the kept queries of R chunks (see ``quoka_query_choice``).
        compressed_keys: ``[B, Hk, W, D]``.
        n_windows: ``[R]`` long, windows complete before each chunk; later windows are not scored.
        n_valid: ``[B, R]`` long, how many of the kept queries (the first ones) are real tokens; default all.
        compressed_bias: ``[B, Hk, W]`` window means of the eviction scores (padding folded in), which mark the
            padding windows; None when the batch has no padding.

    Returns:
        ``[B, Hk, R, N]`` float32 in [0, H / Hk], ``QUOKA_PADDING_SCORE`` for a block whose complete windows are all
        padding windows; -inf for a block without a complete window (or without a real kept query).
    """
    B, H, R, n, D = kept_queries.shape
    Hk, W = compressed_keys.shape[1], compressed_keys.shape[2]
    device = kept_queries.device
    q = kept_queries.float().view(B, Hk, H // Hk, R, n, D) * D**-0.5
    logits = torch.einsum("bkgrnd,bkwd->bkgrnw", q, compressed_keys.float().to(device))
    available = torch.arange(W, device=device) < n_windows.to(device)[:, None]  # [R, W]
    usable = available[None, None, None, :, None, :]
    padding = None
    if compressed_bias is not None:
        padding = _padding_windows(compressed_bias, compressed_keys.shape[:3], "quoka_scores").to(device)  # [B, Hk, W]
        usable = usable & ~padding[:, :, None, None, None, :]
    # a query with no usable window (all padding) gives no mass: 0, not the NaN of an all -inf softmax
    mass = logits.masked_fill(~usable, float("-inf")).softmax(-1).nan_to_num(0.0).sum(2)  # [B, Hk, R, n, W]
    real = torch.arange(n, device=device) < (n_valid.to(device) if n_valid is not None
                                              else torch.full((B, R), n, device=device))[..., None]  # [B, R, n]
    n_real = real.sum(-1)  # [B, R]
    window_scores = (mass * real[:, None, :, :, None]).sum(3) / n_real.clamp(min=1)[:, None, :, None]
    window_scores = window_scores.masked_fill((n_real == 0)[:, None, :, None] | ~available, float("-inf"))
    if padding is not None:
        # at most the padding score: -inf (no window, no real kept query) stays -inf
        window_scores = torch.where(padding[:, :, None, :], window_scores.clamp(max=QUOKA_PADDING_SCORE), window_scores)
    return pool_windows_to_blocks(window_scores, n_blocks, cfg, fill=float("-inf"))


def quoka_select_blocks(
    scores: torch.Tensor, current_block: torch.Tensor | int, cfg: NosaConfig, budget_blocks: int | None = None
) -> torch.Tensor:
    """QUOKA block selection: the sink blocks, the local window and the top-scored blocks, K in all.

    Candidates are the complete blocks before each chunk's first block. Sink and local blocks score +inf; ties go
    to the most recent block.

    Args:
        scores: ``[B, Hk, R, N]`` from ``quoka_scores``.
        current_block: ``[R]`` long, the block where each chunk's own keys begin; or one int shared by the chunks
            (the prefill's one chunk: the forcing is then two slices, fewer launches per layer and chunk).
        budget_blocks: K, default ``cfg.prefill_budget_blocks``.

    Returns:
        ``[B, Hk, R, K]`` long block indices, -1 where fewer than K candidates exist.
    """
    K = cfg.prefill_budget_blocks if budget_blocks is None else budget_blocks
    if isinstance(current_block, int):
        N = scores.shape[-1]
        masked = scores.to(torch.float32, copy=True)
        masked[..., current_block:] = float("-inf")
        candidates = min(current_block, N)
        masked[..., : min(cfg.sink_blocks, candidates)] = float("inf")
        masked[..., max(0, current_block - cfg.local_blocks) : candidates] = float("inf")
    else:
        masked, _ = force_sink_and_local(scores, current_block, cfg)
    return topk_recent_first(masked, K)
