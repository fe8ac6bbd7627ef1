"""The batched decode fetch of continuous batching: one ``fetch_step`` launch over rows that each read and write their
own host store (``serving.host_rows.HostRows``: a block table per row), against the torch reference doing the same
row by row; and ``stack_rows``, which views per-request rows of a shared tensor as one batch."""

from __future__ import annotations

import pytest
import torch

from hf_nosa.attention.pool import part_bounds
from hf_nosa.cache.host_store import HostStore
from hf_nosa.kernels.decode.fetch import SlotPool, StepCounters, fetch_step, fetch_step_ref
from hf_nosa.serving.host_rows import HostRows, stack_rows

from .kernels.test_fetch import check_pool_against_host, clone_host, make_state, next_selection
from .kernels.test_host_write import assert_same_store


def _rows(lengths, Hk, D, P, K, dtype, host_dtype, gen, width=64):
    """One store per row (a sequence of ``lengths[r]`` tokens, host chunks of 3 blocks) whose block tables are
    rows of one shared tensor, and the rows' slot pools in shared ``[R, ...]`` tensors."""
    rows = [make_state(1, Hk, D, P, K, T, dtype, torch.device("cpu"), 3, gen, host_dtype=host_dtype)
            for T in lengths]
    tables = torch.zeros(len(lengths), HostStore.table_rows(host_dtype), width, dtype=torch.long)
    stores = []
    for r, (store, _) in enumerate(rows):
        store._table, store._table_version = tables[r], -1
        stores.append(store)
    pool = SlotPool(*(torch.cat([p[i] for _, p in rows]) for i in range(5)))
    return stores, pool


def _twin(stores, host_dtype, width=64):
    tables = torch.zeros(len(stores), HostStore.table_rows(host_dtype), width, dtype=torch.long)
    twins = []
    for r, store in enumerate(stores):
        twin = clone_host(store)
        twin._table, twin._table_version = tables[r], -1
        twins.append(twin)
    return twins


@pytest.mark.parametrize("lengths,dtype,host_dtype,parts", [
    ((150, 41, 97), torch.float32, "auto", 1),  # rows at different blocks, chunks and tail positions
    ((64, 30, 111, 17), torch.bfloat16, "auto", 1),
    ((75, 120, 33), torch.bfloat16, "float8_e4m3fn", 1),  # quantized stores: tails and block scales per row
    ((64, 30, 111, 17), torch.float32, "int8", 2),  # by parts: the copy runs in fetch_copy's launch
])
def test_a_fetch_over_rows_of_different_stores_matches_the_reference_interpreted(interpret, lengths, dtype,
                                                                                 host_dtype, parts):
    Hk, D, P, K, steps = 2, 32, 16, 4, 12
    gen = torch.Generator().manual_seed(sum(lengths))
    R = len(lengths)
    stores_ref, pool_ref = _rows(lengths, Hk, D, P, K, dtype, host_dtype, gen)
    stores_ker, pool_ker = _twin(stores_ref, host_dtype), SlotPool(*(x.clone() for x in pool_ref))
    counters_ref, counters_ker = StepCounters.zeros("cpu"), StepCounters.zeros("cpu")
    longest = max(lengths)
    offsets = torch.tensor([longest - n for n in lengths])  # row r's token is T - offsets[r] = its own length
    step_ref = torch.tensor([longest])
    step_ker = step_ref.clone()
    selected = torch.full((R, Hk, K), -1, dtype=torch.long)
    for i in range(steps):
        rows_t = [n + i for n in lengths]
        selected = next_selection(selected, [t // P for t in rows_t], K, gen, "cpu")
        k_new = torch.randn(R, 1, Hk, D, generator=gen).to(dtype).transpose(1, 2)  # model layout
        v_new = torch.randn(R, 1, Hk, D, generator=gen).to(dtype).transpose(1, 2)
        b_new = torch.randn(R, 1, Hk, generator=gen).transpose(1, 2)
        for store, t in zip(stores_ref + stores_ker, rows_t + rows_t):
            store.ensure_capacity(t + 1)
        fetch_step_ref(selected, pool_ref, HostRows(stores_ref, "cpu"), k_new, v_new, b_new, step_ref, counters_ref,
                       i > 0, offsets)
        rows = HostRows(stores_ker, "cpu")
        for b0, b1 in part_bounds(R, parts):  # the table stays every row's: a part's row b is row b0 + b
            part = slice(b0, b1)
            fetch_step(selected[part], SlotPool(*(x[part] for x in pool_ker)), rows, k_new[part], v_new[part],
                       b_new[part], step_ker, counters_ker, count_locality=i > 0, offsets=offsets[part], row0=b0,
                       step_rows=R)
        for store, t in zip(stores_ker, rows_t):
            store.mark_device_written(t + 1, torch.device("cpu"))
        S = K + 1
        for name, ref, ker in zip(SlotPool._fields, pool_ref, pool_ker):
            if name in ("slot_k", "slot_v", "slot_b"):  # the scratch slot S is the reference's dumping ground
                ref, ker = ref[:, :, :S], ker[:, :, :S]
            torch.testing.assert_close(ker, ref, rtol=0, atol=0, equal_nan=True, msg=f"step {i}: {name}")
        assert int(step_ker) == int(step_ref) == longest + i + 1
        torch.testing.assert_close(counters_ker.counts, counters_ref.counts, rtol=0, atol=0)
        torch.testing.assert_close(counters_ker.locality, counters_ref.locality, rtol=1e-6, atol=1e-6)
        for r, (store, t) in enumerate(zip(stores_ker, rows_t)):  # each row holds its own store's blocks
            check_pool_against_host(SlotPool(*(x[r : r + 1] for x in pool_ker)), store, t)
    assert int(counters_ker.counts[0]) > 0
    for store_ker, store_ref, n in zip(stores_ker, stores_ref, lengths):
        assert store_ker.length == store_ref.length == n + steps
        assert_same_store(store_ker, store_ref)


def test_stack_rows_views_equally_spaced_rows_and_refuses_the_rest():
    shared = torch.randn(5, 2, 3)
    rows = [shared[r : r + 1] for r in (1, 2, 3)]
    stacked = stack_rows(rows)
    assert stacked.data_ptr() == shared[1].data_ptr() and torch.equal(stacked, shared[1:4])
    stacked[2].fill_(7.0)  # a view: writes reach the shared memory
    assert bool((shared[3] == 7.0).all())
    assert torch.equal(stack_rows([shared[r] for r in (0, 1)], leading=False), shared[:2])
    assert stack_rows([shared[0:1], shared[2:3]]) is not None  # equal spacing of two rows
    assert stack_rows([shared[0:1], shared[1:2], shared[3:4]]) is None  # a gap
    assert stack_rows([shared[0:1], torch.randn(1, 2, 3)]) is None  # another storage
    assert stack_rows([shared[1:2], shared[0:1]]) is None  # out of order
    assert stack_rows([shared[0:2]]) is None  # not one row


def test_host_rows_names_what_does_not_fit():
    one = HostStore(1, 2, 8, torch.float32, 16, pin=False)
    two = HostStore(2, 2, 8, torch.float32, 16, pin=False)
    with pytest.raises(ValueError, match="batch=2"):
        HostRows([one, two], "cpu")
    other = HostStore(1, 2, 8, torch.float32, 32, pin=False)
    with pytest.raises(ValueError, match="block_size=32"):
        HostRows([one, other], "cpu")
    one.reserve(32)
    other = HostStore(1, 2, 8, torch.float32, 16, pin=False)
    other.reserve(32)
    with pytest.raises(ValueError, match="not rows of one shared tensor"):
        HostRows([one, other], "cpu")


def test_a_runs_views_are_built_once_and_again_when_a_rows_buffer_changes(monkeypatch):
    """``decode_batch._cached_views``: the views of a run's shared buffers are kept while every row holds the same
    buffers, rebuilt when one is replaced (a grown compressed key bank), when a host block table is out of date, or
    for other rows."""
    from types import SimpleNamespace

    from hf_nosa.serving import decode_batch

    built = []
    monkeypatch.setattr(decode_batch, "_views", lambda run: built.append([r.row for r in run]) or {"n": len(built)})

    def layer():
        t = lambda: torch.zeros(1)  # noqa: E731
        host = SimpleNamespace(_table=t(), _table_version=3, _version=3)
        compressed = SimpleNamespace(keys=t(), bias=t(), ring_k=t(), ring_b=t())
        return SimpleNamespace(slot_k=t(), slot_v=t(), slot_b=t(), slot_block=t(), tail_slot=t(),
                               compressed=compressed, host=host)

    requests = SimpleNamespace(run_views={}, n_layers=2)
    layers = [layer() for _ in range(3)]
    run = [decode_batch._Row(request_id=f"r{i}", row=i, layer=layers[i]) for i in range(3)]
    first = decode_batch._cached_views(requests, 0, run)
    assert decode_batch._cached_views(requests, 0, run) is first and built == [[0, 1, 2]]
    layers[1].compressed.keys = torch.zeros(2)  # grown: a new tensor
    assert decode_batch._cached_views(requests, 0, run) is not first and len(built) == 2
    layers[2].host._version += 1  # the store grew and its table was not refilled yet
    decode_batch._cached_views(requests, 0, run)
    assert len(built) == 3
    layers[2].host._table_version = layers[2].host._version
    decode_batch._cached_views(requests, 0, run)
    assert len(built) == 3
    decode_batch._cached_views(requests, 1, run)  # another layer: its own views
    decode_batch._cached_views(requests, 0, run[:2])  # other rows
    assert built[-2:] == [[0, 1, 2], [0, 1]]
    run[0] = decode_batch._Row(request_id="new", row=0, layer=layer())  # a new request on a freed row
    decode_batch._cached_views(requests, 0, run)
    assert len(built) == 6


def test_a_step_graph_key_names_the_memory_its_views_read_and_whether_the_banks_hold_it():
    """``decode_batch._signature``: views of the same bank rows get one id whichever requests hold the rows (so a
    step's graph serves the next requests on them); other rows, another shape or memory outside the banks do not,
    and memory outside the banks is flagged (its graph stays the requests' own)."""
    from types import SimpleNamespace

    from hf_nosa.serving import decode_batch
    from hf_nosa.serving.row_pool import RowPool

    rows = RowPool(4)
    names = decode_batch.POOL + decode_batch.COMPRESSED
    bank_of = {"keys": "compressed_keys", "bias": "compressed_bias"}
    for name in names:  # one bank per buffer, opened as a request's first row buffers open them
        rows.take(0, (0, bank_of.get(name, name)), (1, 3, 5), torch.float32, "cpu")
    rows.take(0, (0, "host_table"), (4, 8), torch.long, "cpu")
    banks = {name: rows.banks[(0, bank_of.get(name, name))][0] for name in (*names, "host_table")}
    host = SimpleNamespace(block_size=16, host_dtype="auto", format=None, kv_heads=3, head_dim=5, dtype=torch.float32,
                           pin=False)

    def views(lo, hi, **replace):
        made = {name: banks[name][lo:hi] for name in names}
        made["host"] = SimpleNamespace(table=banks["host_table"][lo:hi], **vars(host))
        made.update(replace)
        return made

    requests = SimpleNamespace(rows=rows, view_ids={}, next_view_id=0)
    first, again = decode_batch._signature(requests, views(0, 2)), decode_batch._signature(requests, views(0, 2))
    assert first == again and first[1] is True  # new views of the same rows: the same id, all in the banks
    assert decode_batch._signature(requests, views(1, 3))[0] != first[0]  # other rows
    assert decode_batch._signature(requests, views(0, 1))[0] != first[0]  # fewer rows
    own = torch.zeros(2, 3, 5)
    private = decode_batch._signature(requests, views(0, 2, keys=own))
    assert private[0] != first[0] and private[1] is False  # a buffer outside the banks
    other_layout = views(0, 2)
    other_layout["host"].block_size = 32
    assert decode_batch._signature(requests, other_layout)[0] != first[0]
    cached = views(0, 2)
    decode_batch._signature(requests, cached)
    cached["keys"] = own  # a views dict keeps its signature: views are rebuilt when a buffer changes
    assert decode_batch._signature(requests, cached) == first


def test_a_whole_step_takes_layer_zeros_runs_only_where_every_layer_would_group_alike():
    """``plan_whole_step`` gives every layer layer 0's runs without grouping it again (``_grouped_alike``): only
    where each row there has layer 0's request, row, warm state and config, so ``_group`` would cut the same runs;
    anything else sends the step down the eager path."""
    from types import SimpleNamespace

    from hf_nosa import NosaConfig
    from hf_nosa.serving.decode_batch import _group, _grouped_alike, _Row

    cfg, short = NosaConfig(), NosaConfig(budget_tokens=8192)

    def rows(warm=(True, True, False), cfgs=(cfg, cfg, cfg), ids=("a", "b", "c"), at=(0, 1, 2)):
        return [_Row(request_id=i, row=r, position=r, t=9, layer=SimpleNamespace(warm=w, cfg=c))
                for i, r, w, c in zip(ids, at, warm, cfgs)]

    first = rows()
    assert [[r.request_id for r in run] for run in _group(first)] == [["a", "b"], ["c"]]
    assert _grouped_alike(rows(cfgs=(cfg, NosaConfig(), cfg)), first)  # an equal config, not the same object
    for other in (rows(warm=(True, False, False)), rows(cfgs=(cfg, short, cfg)), rows(ids=("a", "c", "b")),
                  rows(at=(0, 1, 3)), rows()[:2]):
        assert not _grouped_alike(other, first)
        # where it says no, grouping that layer again would indeed cut other runs (or other requests)
        regrouped = [[(r.request_id, r.row) for r in run] for run in _group(other)]
        assert regrouped != [[(r.request_id, r.row) for r in run] for run in _group(first)]
