"""fetch_step (one Triton launch: plan, UVA copy, tail and host write, counters) against its torch reference.

A trajectory of decode steps runs through both paths from the same state; after every step the slot pools,
tables, counters and host stores must be identical, and the pool must hold exactly what the host store holds at
every position that has a token (``MASK_VALUE`` in ``slot_b`` everywhere else).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_nosa.cache.host_quant import quantization_error_bound
from hf_nosa.cache.host_store import HostStore
from hf_nosa.kernels.decode.fetch import BLOCKS_ENV_VAR, SlotPool, StepCounters, blocks_per_copy, fetch_step, fetch_step_ref
from hf_nosa.attention.pool import part_bounds
from hf_nosa.rules.selection import MASK_VALUE

from .test_host_write import assert_same_store

# The checks read host stores with ``read_torch`` (the reference of ``kernels.host_read``, tested against it in
# test_host_read): through the interpreted read kernel they took ~90% of this file's time.


def make_state(B, Hk, D, P, K, T, dtype, device, chunk_blocks, gen, offsets=None, host_dtype="auto"):
    """A host store holding T tokens (several chunks) and a slot pool poisoned with NaN, tail holding T's block.

    With ``offsets`` row b is stored row-relative (``hf_nosa.rules.padding``): its tokens end at ``T - offsets[b]`` and its
    tail holds that block."""
    host = HostStore(B, Hk, D, dtype, P, pin=device.type == "cuda", host_dtype=host_dtype)
    host.chunk_tokens = chunk_blocks * P  # several host chunks: blocks are found through the block table
    k = torch.randn(B, Hk, T, D, generator=gen).to(dtype)
    v = torch.randn(B, Hk, T, D, generator=gen).to(dtype)
    # heavy-tailed tokens: blocks of very different scales, as real keys have
    k = (k.float() * torch.exp(torch.randn(B, Hk, T, 1, generator=gen))).to(dtype)
    if offsets is None:
        host.write(0, k, v, torch.randn(B, Hk, T, generator=gen))
    else:  # each row from its first real token, as a padded prompt is stored
        host.set_offsets(offsets.cpu())
        host.write_rows(-offsets.cpu(), k, v, torch.randn(B, Hk, T, generator=gen))
        k = torch.stack([k[b].roll(-int(offsets[b]), dims=1) for b in range(B)])  # row-relative, as stored
        v = torch.stack([v[b].roll(-int(offsets[b]), dims=1) for b in range(B)])
    host.wait_writes()
    S = K + 1
    nan = float("nan")
    pool = SlotPool(
        torch.full((B, Hk, S + 1, P, D), nan, dtype=dtype, device=device),
        torch.full((B, Hk, S + 1, P, D), nan, dtype=dtype, device=device),
        torch.full((B, Hk, S + 1, P), nan, dtype=torch.float32, device=device),
        torch.full((B, Hk, S), -1, dtype=torch.long, device=device),
        torch.zeros(B, Hk, dtype=torch.long, device=device),
    )
    hk, hv, hb = host.read_torch(0, T, device)
    for b in range(B):
        L = T - (0 if offsets is None else int(offsets[b]))
        n_tail = L % P
        if n_tail:  # like NosaLayer._settle_rows: the partly written block sits in slot 0
            pool.slot_k[b, :, 0, :n_tail] = hk[b, :, L - n_tail : L]  # the store's tail: the tokens as they came
            pool.slot_v[b, :, 0, :n_tail] = hv[b, :, L - n_tail : L]
            pool.slot_b[b, :, 0, :n_tail] = hb[b, :, L - n_tail : L]
            pool.slot_block[b, :, 0] = L // P
    return host, pool


def clone_host(host: HostStore) -> HostStore:
    twin = copy.copy(host)
    for name in ("k_chunks", "v_chunks", "b_chunks", "ks_chunks", "vs_chunks"):
        setattr(twin, name, [chunk.clone().pin_memory() if host.pin else chunk.clone() for chunk in getattr(host, name)])
    if host.format is not None:
        twin.tail_k, twin.tail_v = (t.clone().pin_memory() if host.pin else t.clone() for t in (host.tail_k, host.tail_v))
    twin.starts = list(host.starts)
    twin.offsets = host.offsets.clone()
    twin._table, twin._version = None, host._version + 1
    return twin


def next_selection(prev, c, K, gen, device):
    """Mostly the previous blocks (locality), some new ones, a few rows with fewer than K; all < c (an int, or a
    list per row), unique."""
    B, Hk, _ = prev.shape
    out = torch.full((B, Hk, K), -1, dtype=torch.long)
    rows_c = c if isinstance(c, list) else [c] * B
    for b in range(B):
        c = rows_c[b]
        for h in range(Hk):
            keep = [int(x) for x in prev[b, h] if 0 <= x < c and torch.rand(1, generator=gen) < 0.7]
            rest = [int(x) for x in torch.randperm(c, generator=gen) if int(x) not in keep]
            n = min(c, K - int(torch.randint(0, 2, (1,), generator=gen)))
            row = (keep + rest)[:n]
            out[b, h, : len(row)] = torch.tensor(row, dtype=torch.long)[torch.randperm(len(row), generator=gen)]
    return out.to(device)


def check_pool_against_host(pool: SlotPool, host: HostStore, t):
    """Every slot position holding a token equals the host store there; every other position has b = MASK.
    ``t``: the last token, an int or a list per row (row-relative)."""
    B, Hk, S = pool.slot_block.shape
    P = pool.slot_k.shape[3]
    rows_t = t if isinstance(t, list) else [t] * B
    hk, hv, hb = host.read_torch(0, max(rows_t) + 1, "cpu")
    blocks = pool.slot_block.cpu()
    for b in range(B):
        t = rows_t[b]
        for h in range(Hk):
            for s in range(S):
                blk = int(blocks[b, h, s])
                n = 0 if blk < 0 else min(P, t + 1 - blk * P)
                got_b = pool.slot_b[b, h, s].cpu()
                assert torch.all(got_b[n:] == MASK_VALUE), (b, h, s, blk)
                if n:
                    lo = blk * P
                    for slots, held in ((pool.slot_k, hk), (pool.slot_v, hv)):
                        got, want = slots[b, h, s, :n].cpu(), held[b, h, lo : lo + n]
                        if host.format is None or n < P:
                            assert torch.equal(got, want)
                        else:  # a block completed while resident stays as written; the store holds it quantized
                            bound = quantization_error_bound(slots[b, h, s].cpu(), host.host_dtype)
                            error = (got.float() - want.float()).abs()
                            assert bool((error <= bound + want.float().abs() * 2.0**-8).all())  # + bf16 rounding
                    assert torch.equal(got_b[:n], hb[b, h, lo : lo + n])


def run_trajectory(B, Hk, D, P, K, T, dtype, device, steps, chunk_blocks=4, seed=0, offsets=None, host_dtype="auto",
                   parts=1):
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    offs = [0] * B if offsets is None else list(offsets)
    offsets = None if offsets is None else torch.tensor(offsets, device=device)
    host_ref, pool_ref = make_state(B, Hk, D, P, K, T, dtype, device, chunk_blocks, gen, offsets, host_dtype)
    host_ker, pool_ker = clone_host(host_ref), SlotPool(*(x.clone() for x in pool_ref))
    counters_ref, counters_ker = StepCounters.zeros(device), StepCounters.zeros(device)
    step_ref = torch.tensor([T], device=device)
    step_ker = step_ref.clone()
    selected = torch.full((B, Hk, K), -1, dtype=torch.long, device=device)
    for i in range(steps):
        t = T + i
        rows_t = [t - off for off in offs]  # row-relative index of each row's new token
        selected = next_selection(selected.cpu(), [r // P for r in rows_t], K, gen, device)
        k_new = torch.randn(B, 1, Hk, D, generator=gen).to(dtype).to(device).transpose(1, 2)  # model layout
        v_new = torch.randn(B, 1, Hk, D, generator=gen).to(dtype).to(device).transpose(1, 2)
        b_new = torch.randn(B, 1, Hk, generator=gen).to(device).transpose(1, 2)
        for host in (host_ref, host_ker):
            host.ensure_capacity(t + 1)
        fetch_step_ref(selected, pool_ref, host_ref, k_new, v_new, b_new, step_ref, counters_ref, i > 0, offsets)
        for b0, b1 in part_bounds(B, parts):  # rows b0 .. b1 - 1 of the batch (hf_nosa.cache.decode_parts)
            rows = slice(b0, b1)
            fetch_step(selected[rows], SlotPool(*(x[rows] for x in pool_ker)), host_ker, k_new[rows], v_new[rows],
                       b_new[rows], step_ker, counters_ker, count_locality=i > 0,
                       offsets=None if offsets is None else offsets[rows], row0=b0, step_rows=B)
        host_ker.mark_device_written(t + 1, device)
        S = K + 1
        for name, ref, ker in zip(SlotPool._fields, pool_ref, pool_ker):
            if name in ("slot_k", "slot_v", "slot_b"):  # the scratch slot S is the reference's dumping ground
                ref, ker = ref[:, :, :S], ker[:, :, :S]
            torch.testing.assert_close(ker, ref, rtol=0, atol=0, equal_nan=True, msg=f"step {i}: {name}")
        assert int(step_ker) == int(step_ref) == t + 1
        torch.testing.assert_close(counters_ker.counts, counters_ref.counts, rtol=0, atol=0)
        torch.testing.assert_close(counters_ker.locality, counters_ref.locality, rtol=1e-6, atol=1e-6)
        check_pool_against_host(pool_ker, host_ker, rows_t)
        if offsets is not None and host_dtype == "auto":  # the new token went to each row's own index
            stored = host_ker.read_torch(0, t + 1, "cpu")[0]
            for b, r in enumerate(rows_t):
                assert torch.equal(stored[b, :, r], k_new[b, :, 0].cpu())
    for which in range(3):
        for b, off in enumerate(offs):  # what each row wrote (a row-relative row ends `off` tokens early)
            end = T + steps - off
            torch.testing.assert_close(host_ker.read_torch(0, end, "cpu")[which][b, :, :end],
                                       host_ref.read_torch(0, end, "cpu")[which][b, :, :end], rtol=0, atol=0)
    assert_same_store(host_ker, host_ref)  # the bytes and scales of the blocks decoding completed, the tails
    assert int(counters_ker.counts[2:].abs().sum()) == 0  # the kernel's scratch counters return to zero


CPU_CASES = [  # B, Hk, D, P, K, T, dtype, steps
    (3, 2, 64, 16, 6, 150, torch.float32, 16),  # crosses block 160 and host chunks of 64 tokens
    (1, 8, 128, 16, 3, 45, torch.bfloat16, 8),
    (1, 1, 64, 32, 4, 96, torch.float32, 4),  # starts on a block boundary: no tail
    (3, 1, 64, 16, 2, 29, torch.float16, 5),
]


@pytest.mark.parametrize("B,Hk,D,P,K,T,dtype,steps", CPU_CASES)
def test_trajectory_matches_reference_interpreted(interpret, B, Hk, D, P, K, T, dtype, steps):
    run_trajectory(B, Hk, D, P, K, T, dtype, "cpu", steps)


@pytest.mark.parametrize("host_dtype, parts", [("float8_e4m3fn", 3)])  # the bf16 store: test_decode_parts' GPU test
def test_trajectory_by_parts_matches_reference_interpreted(interpret, host_dtype, parts):
    """A step fetched a part of the batch at a time (the plan launch, then the copy launch with several programs
    per row) holds what the whole-batch reference holds; the step advances once per step, not once per part."""
    run_trajectory(3, 2, 32, 16, 4, 150, torch.float32, "cpu", 12, offsets=(0, 13, 40), host_dtype=host_dtype,
                   parts=parts)


@pytest.mark.parametrize("offsets", [(0, 13, 40), (7, 0, 100)])
def test_row_offsets_trajectory_matches_reference_interpreted(interpret, offsets):
    """Rows at different row-relative indices (left padding 0..100 tokens): new blocks start, tails fill and tokens
    land in the host store at each row's own index, in the kernel as in the reference."""
    run_trajectory(3, 2, 64, 16, 4, 150, torch.float32, "cpu", 12, offsets=offsets)


@pytest.mark.parametrize("host_dtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("B,Hk,D,P,K,T,dtype,steps,offsets", [
    (2, 2, 32, 16, 4, 41, torch.bfloat16, 9, None),  # blocks completed by decoding (t = 47) are quantized
    (3, 1, 24, 16, 3, 60, torch.float32, 9, (0, 5, 18)),  # rows completing blocks at different steps
    (1, 2, 16, 16, 3, 31, torch.float16, 3, None),
])
def test_quantized_store_trajectory_matches_reference_interpreted(interpret, host_dtype, B, Hk, D, P, K, T, dtype,
                                                                  steps, offsets):
    """A quantized host store: blocks come into the pool dequantized, new tokens go to the tails, a completed block
    is quantized from the tail slot, in the kernel exactly as in the reference (pool, counters, store bytes)."""
    run_trajectory(B, Hk, D, P, K, T, dtype, "cpu", steps, offsets=offsets, host_dtype=host_dtype)


@pytest.mark.parametrize("blocks,host_dtype", [("1", "auto"), ("4", "float8_e4m3fn")])
def test_blocks_per_copy_setting_keeps_the_trajectory(interpret, monkeypatch, blocks, host_dtype):
    """HF_NOSA_FETCH_BLOCKS changes how many missing blocks a program copies per iteration, not what lands: the
    kernel still matches the reference with fewer and with more missing blocks than one iteration's worth."""
    monkeypatch.setenv(BLOCKS_ENV_VAR, blocks)
    run_trajectory(2, 2, 32, 16, 6, 150, torch.bfloat16, "cpu", 6, host_dtype=host_dtype)


@pytest.mark.parametrize("value", ["0", "3", "two", "16"])
def test_blocks_per_copy_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv(BLOCKS_ENV_VAR, value)
    with pytest.raises(ValueError, match="HF_NOSA_FETCH_BLOCKS"):
        blocks_per_copy()


def test_bad_input(interpret):
    gen = torch.Generator().manual_seed(0)
    host, pool = make_state(1, 2, 64, 16, 4, 40, torch.float32, torch.device("cpu"), 4, gen)
    sel = torch.full((1, 2, 4), -1, dtype=torch.long)
    k = torch.randn(1, 2, 1, 64)
    b = torch.randn(1, 2, 1)
    step, counters = torch.tensor([40]), StepCounters.zeros("cpu")
    with pytest.raises(ValueError, match="selected"):
        fetch_step(sel.int(), pool, host, k, k, b, step, counters, count_locality=False)
    with pytest.raises(ValueError, match="slots"):
        fetch_step(torch.full((1, 2, 5), -1), pool, host, k, k, b, step, counters, count_locality=False)
    with pytest.raises(ValueError, match="k_new"):
        fetch_step(sel, pool, host, k.half(), k, b, step, counters, count_locality=False)
    with pytest.raises(ValueError, match="b_new"):
        fetch_step(sel, pool, host, k, k, b.double(), step, counters, count_locality=False)
    with pytest.raises(ValueError, match="step"):
        fetch_step(sel, pool, host, k, k, b, step.int(), counters, count_locality=False)


GPU_CASES = [  # decode-sized: budget 4096 in 64-token blocks
    (4, 8, 128, 64, 64, 5000, torch.bfloat16, 6),
    (3, 8, 64, 64, 64, 9000, torch.bfloat16, 4),  # two host chunks of 8192 tokens
    (1, 2, 128, 64, 16, 2000, torch.float32, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hk,D,P,K,T,dtype,steps", GPU_CASES)
def test_trajectory_matches_reference_gpu(monkeypatch, B, Hk, D, P, K, T, dtype, steps):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    run_trajectory(B, Hk, D, P, K, T, dtype, "cuda", steps, chunk_blocks=128)


@pytest.mark.gpu
@pytest.mark.parametrize("host_dtype", ["float8_e4m3fn", "int8"])
def test_quantized_trajectory_matches_reference_gpu(monkeypatch, host_dtype):
    """Compiled: the same bits as the reference (the roundings are integer operations, the divisions div_rn)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    # rows of 5050, 5047, 4986 and 5045 tokens complete a block at steps 6, 9, 6 and 11
    run_trajectory(4, 8, 128, 64, 64, 5050, torch.bfloat16, "cuda", 12, chunk_blocks=128, offsets=(0, 3, 64, 5),
                   host_dtype=host_dtype)


@pytest.mark.gpu
def test_unpinned_store_on_cuda(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    host, pool = make_state(1, 2, 64, 16, 4, 40, torch.float32, torch.device("cuda"), 4, gen)
    host.pin = False
    args = (torch.full((1, 2, 4), -1, dtype=torch.long, device="cuda"), pool, host,
            torch.randn(1, 2, 1, 64, device="cuda"), torch.randn(1, 2, 1, 64, device="cuda"),
            torch.randn(1, 2, 1, device="cuda"), torch.tensor([40], device="cuda"), StepCounters.zeros("cuda"))
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    with pytest.raises(ValueError, match="pinned"):
        fetch_step(*args, count_locality=False)
    monkeypatch.delenv("HF_NOSA_KERNELS")
    fetch_step(*args, count_locality=False)  # automatic: the torch reference, logged once
    assert int(args[6]) == 41


@pytest.mark.parametrize("B,Hk,D,P,K,T,dtype,host_dtype", [
    (2, 2, 64, 16, 5, 200, torch.float32, "auto"),
    (1, 3, 32, 16, 3, 90, torch.bfloat16, "auto"),
    (1, 2, 32, 16, 3, 90, torch.bfloat16, "float8_e4m3fn"),  # blocks dequantized into the pool
])
def test_fetch_selection_matches_reference_interpreted(interpret, B, Hk, D, P, K, T, dtype, host_dtype):
    """The no-token mode of the fetch kernel (QUOKA chunks): the pool holds exactly the selection, blocks kept from
    the previous selection stay in their slots, empty slots carry MASK_VALUE, the counters match."""
    from hf_nosa.kernels.decode.fetch import fetch_selection, fetch_selection_ref

    gen = torch.Generator().manual_seed(3)
    device = torch.device("cpu")
    host_ref, pool_ref = make_state(B, Hk, D, P, K + 2, T, dtype, device, 4, gen, host_dtype=host_dtype)
    host_ker, pool_ker = clone_host(host_ref), SlotPool(*(x.clone() for x in pool_ref))
    counters_ref, counters_ker = StepCounters.zeros(device), StepCounters.zeros(device)
    selected = torch.full((B, Hk, K), -1, dtype=torch.long)
    for _ in range(4):
        selected = next_selection(selected, T // P, K, gen, device)
        fetch_selection_ref(selected, pool_ref, host_ref, counters_ref)
        fetch_selection(selected, pool_ker, host_ker, counters_ker)
        S = pool_ref.slot_block.shape[-1]
        for name, ref, ker in zip(SlotPool._fields, pool_ref, pool_ker):
            if name == "tail_slot":
                continue
            if name in ("slot_k", "slot_v", "slot_b"):
                ref, ker = ref[:, :, :S], ker[:, :, :S]
            torch.testing.assert_close(ker, ref, rtol=0, atol=0, equal_nan=True, msg=name)
        torch.testing.assert_close(counters_ker.counts, counters_ref.counts, rtol=0, atol=0)
        held = pool_ker.slot_block
        for b in range(B):
            for h in range(Hk):
                assert sorted(x for x in held[b, h].tolist() if x >= 0) == sorted(x for x in selected[b, h].tolist() if x >= 0)
