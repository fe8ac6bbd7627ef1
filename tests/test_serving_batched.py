"""The decode tokens of a continuous-batching step as one batched update per layer (``serving.decode_batch``), on
the device kernels under the Triton interpreter: every request still gets the tokens NOSA ``generate`` gives it
alone, several requests share each batched update, the manager's counters still sum what each request moved, and
a cancelled request's row of the shared slot pools goes to the next request."""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig

from hf_nosa.serving import MIN_TRANSFORMERS

if Version(Version(transformers.__version__).base_version) < MIN_TRANSFORMERS:
    pytest.skip(f"serving needs transformers >= {MIN_TRANSFORMERS}", allow_module_level=True)

from hf_nosa import NosaCache  # noqa: E402
from hf_nosa.serving import ServingBudget, enable, init_continuous_batching  # noqa: E402
from hf_nosa.serving.row_pool import RowPool  # noqa: E402

from .test_serving import _generation_config, _prompts, _record_plans, _sparse_model, _wait_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 6


def _alone(model, prompt, new_tokens=NEW):
    cache = NosaCache(model.config)
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         generation_config=_generation_config(new_tokens))
    return out[0, len(prompt):].tolist(), cache.stats()


def _count_plans(monkeypatch):
    """Record each step plan built (``(layer, decode rows)``) and each host-to-device copy of plan tensors."""
    from hf_nosa.serving import decode_batch

    built, copies = [], []
    plan_step, device_ints = decode_batch.plan_step, decode_batch._device_ints

    def counted_plan(requests, layer_idx, device):
        plan = plan_step(requests, layer_idx, device)
        built.append((layer_idx, sum(len(run.ids) for run in plan.runs)))
        return plan

    def counted_ints(values, device):
        copies.append(None)
        return device_ints(values, device)

    monkeypatch.setattr(decode_batch, "plan_step", counted_plan)
    monkeypatch.setattr(decode_batch, "_device_ints", counted_ints)
    return built, copies


@pytest.mark.slow
def test_batched_decode_steps_equal_generate_alone_interpreted(interpret, prompt_rotary_on_torch, monkeypatch):
    """Prompts of 60, 90 and 150 tokens under a 128-token step: the short ones decode together while the long one
    arrives in pieces; each request's tokens equal generate alone on the same kernels, batched updates of two
    and three rows ran, and each step's plan (rows, runs, their device tensors) was built once, not per layer."""
    model = _sparse_model("llama", seed=21)
    prompts = _prompts((60, 90, 150), seed=21)
    alone = [_alone(model, p) for p in prompts]
    enable(model)
    plans = _record_plans(model)
    built, copies = _count_plans(monkeypatch)
    try:
        out = model.generate_batch(prompts, generation_config=_generation_config(NEW),
                                   continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128),
                                   persistent_manager=True)
        requests = model._cached_continuous_batching_manager.nosa_requests
        stats, runs = requests.stats(), dict(requests.decode_runs)
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert [out[f"req_{i}"].generated_tokens for i in range(len(prompts))] == [tokens for tokens, _ in alone]
    layers = model.config.num_hidden_layers
    decode_tokens = sum(n == 1 for plan in plans for _, _, n in plan)
    assert sum(rows * count for rows, count in runs.items()) == decode_tokens * layers  # every decode token batched
    # the step's plan and its device tensors: once per forward step (at layer 0), not once per layer
    assert len(built) == len(plans) and all(layer == 0 for layer, _ in built)
    assert [n for _, n in built] == [sum(n == 1 for _, _, n in plan) for plan in plans]
    assert len(copies) == sum(n > 0 for _, n in built)  # one host-to-device copy per step with decode tokens
    assert runs.get(2, 0) > 0 and runs.get(3, 0) > 0, runs  # several requests in one update
    assert any(len(plan) > 1 and any(n > 1 for _, _, n in plan) for plan in plans)  # prompt pieces beside decoding
    assert stats["blocks_loaded"] == sum(s["blocks_loaded"] for _, s in alone) > 0
    assert stats["bytes_to_device"] == sum(s["bytes_to_device"] for _, s in alone)
    assert 0.0 <= stats["locality"] <= 1.0


@pytest.mark.slow
def test_a_cancelled_request_frees_its_row_for_the_next_interpreted(interpret, prompt_rotary_on_torch):
    model = _sparse_model("llama", seed=23)
    first, cancelled, late = _prompts((60, 70, 66), seed=23)  # no budget cut: one slot pool shape
    expected_first, expected_late = _alone(model, first, 12)[0], _alone(model, late)[0]
    manager = init_continuous_batching(model, _generation_config(NEW), ContinuousBatchingConfig(max_batch_tokens=128),
                                       budget=ServingBudget(decode_rows=4))
    requests = manager.nosa_requests
    manager.start()
    try:
        # the cancelled request first: row 0, the lowest free row again after the cancel whether or not "first"
        # (row 1) has finished by then
        manager.add_request(cancelled, request_id="cancelled", max_new_tokens=200)
        manager.add_request(first, request_id="first", max_new_tokens=12)
        _wait_for(lambda: "cancelled" in requests.entries and requests.entries["cancelled"].cache is not None
                  and requests.entries["cancelled"].cache.get_seq_length() > len(cancelled), timeout=120)
        row = requests.entries["cancelled"].row
        assert row == 0 and requests.host_pool.held_bytes("cancelled") > 0
        slot_k = requests.entries["cancelled"].cache.layers[0].slot_k.data_ptr()
        manager.cancel_request("cancelled")
        # release pops the entry, then gives back its host buffers and its row: wait for the whole of it
        _wait_for(lambda: "cancelled" not in requests.entries and row in requests.rows.free_rows
                  and requests.host_pool.held_bytes("cancelled") == 0, timeout=60)
        manager.add_request(late, request_id="late")
        _wait_for(lambda: "late" in requests.entries and requests.entries["late"].cache is not None
                  and requests.entries["late"].cache.layers[0].is_initialized, timeout=120)
        assert requests.entries["late"].row == row  # the lowest free row: the cancelled request's
        assert requests.entries["late"].cache.layers[0].slot_k.data_ptr() == slot_k  # the same shared memory
        results = {}
        _wait_for(lambda: results.update({r.request_id: r for r in [manager.get_result(timeout=0.05)] if r
                                          and r.is_finished()}) or {"first", "late"} <= set(results), timeout=300)
    finally:
        manager.stop(block=True, timeout=10)
    assert results["first"].generated_tokens == expected_first
    assert results["late"].generated_tokens == expected_late
    assert requests.entries == {} and sorted(requests.rows.free_rows) == list(range(4))


def test_the_row_pool_hands_out_rows_of_shared_banks():
    rows = RowPool(3)
    a, b = rows.assign(), rows.assign()
    assert (a, b) == (0, 1)
    slot_a = rows.take(a, (0, "slot_k"), (1, 2, 5, 4, 8), torch.float32, "cpu")
    slot_b = rows.take(b, (0, "slot_k"), (1, 2, 5, 4, 8), torch.float32, "cpu")
    assert slot_a.shape == (1, 2, 5, 4, 8) and slot_b.data_ptr() - slot_a.data_ptr() == slot_a.numel() * 4
    keys = rows.take(a, (0, "compressed_keys"), (1, 2, 64, 8), torch.float32, "cpu")
    shorter = rows.take(b, (0, "compressed_keys"), (1, 2, 16, 8), torch.float32, "cpu")
    assert shorter.shape == keys.shape  # a capacity dimension comes as large as the bank's
    longer = rows.take(b, (0, "compressed_keys"), (1, 2, 128, 8), torch.float32, "cpu")
    assert longer.shape[2] == 128 and len(rows.banks[(0, "compressed_keys")]) == 2
    table = rows.take(a, (0, "host_table"), (4, 64), torch.int64, "cpu")
    assert table.shape == (4, 64)  # a block table has no batch dimension: the row is bank[r]
    assert rows.take(a, (0, "host_k_0"), (1, 2, 64, 8), torch.float32, "cpu") is None  # host chunks: the HostPool's
    assert rows.take(a, (0, "slot_k"), (2, 2, 5, 4, 8), torch.float32, "cpu") is None  # a batch of 2: no row
    rows.give_back(a)
    assert rows.assign() == 0 and rows.assign() == 2 and rows.assign() is None
    with pytest.raises(ValueError, match="max_rows=0"):
        RowPool(0)
    with pytest.raises(ValueError, match="decode_rows=0"):
        ServingBudget(decode_rows=0)


def test_the_torch_reference_path_decodes_request_by_request(monkeypatch):
    """Without the device kernels (the CPU default) no batched update runs: each request's own update is the
    reference the batched step is tested against."""
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    model = enable(_sparse_model("llama", seed=25))
    prompts = _prompts((60, 70), seed=25)
    try:
        model.generate_batch(prompts, generation_config=_generation_config(3),
                             continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128),
                             persistent_manager=True)
        requests = model._cached_continuous_batching_manager.nosa_requests
        assert requests.decode_runs == {} and requests.step_counters == {}
        assert requests.rows.bank_bytes() > 0  # the rows are still views of the shared slot pools
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_a_shorter_request_moves_into_the_wider_bank_to_batch_with_a_longer_one():
    """Requests whose compressed keys and block tables came from banks of different capacities: the shorter one's
    move into the wider bank (its windows and table kept), after which both rows stack as one batch."""
    from types import SimpleNamespace

    from hf_nosa.cache.compressed_keys import CompressedKeys
    from hf_nosa.cache.host_store import HostStore
    from hf_nosa.serving.decode_batch import _widen
    from hf_nosa.serving.host_rows import HostRows, stack_rows

    from .conftest import SPARSE, small_nosa_config

    cfg = small_nosa_config(**SPARSE)
    rows = RowPool(2)
    g = torch.Generator().manual_seed(27)
    layers = []
    for row, tokens in ((0, 600), (1, 3000)):  # 256 and 1024 windows; 64 and 256 blocks of table
        def take(name, shape, dtype, device, row=row):
            return rows.take(row, (0, name), shape, dtype, device)

        like = torch.zeros(1, 2, 1, 8)
        compressed = CompressedKeys(cfg, like, tokens=tokens, allocate=take)
        compressed.keys.copy_(torch.randn(compressed.keys.shape, generator=g))
        compressed.bias.copy_(torch.randn(compressed.bias.shape, generator=g))
        blocks = tokens // cfg.block_size
        table = take("host_table", (4, 1 << (blocks - 1).bit_length()), torch.int64, "cpu").zero_()
        host = HostStore(1, 2, 8, torch.float32, cfg.block_size, pin=False, table=table)
        host.reserve(tokens)
        host.write(0, torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g),
                   torch.randn(1, 2, 40, generator=g))
        layers.append(SimpleNamespace(compressed=compressed, host=host, layer_idx=0, device=torch.device("cpu")))
    short, long = layers
    assert stack_rows([short.compressed.keys, long.compressed.keys]) is None  # two banks
    kept_keys, kept_bias = short.compressed.keys.clone(), short.compressed.bias.clone()
    table = short.host.block_table("cpu").clone()
    _widen(rows, 0, short)
    n = kept_keys.shape[2]
    assert short.compressed.keys.shape == long.compressed.keys.shape
    assert torch.equal(short.compressed.keys[:, :, :n], kept_keys) and not short.compressed.keys[:, :, n:].any()
    assert torch.equal(short.compressed.bias[:, :, :n], kept_bias) and not short.compressed.bias[:, :, n:].any()
    widened = short.host.block_table("cpu")
    assert torch.equal(widened[:, : table.shape[1]], table) and not widened[:, table.shape[1]:].any()
    assert stack_rows([short.compressed.keys, long.compressed.keys]) is not None
    assert HostRows([short.host, long.host], "cpu").table.shape[0] == 2
    pointers = (short.compressed.keys.data_ptr(), short.host.block_table("cpu").data_ptr())
    _widen(rows, 0, short)  # once there, nothing moves
    assert (short.compressed.keys.data_ptr(), short.host.block_table("cpu").data_ptr()) == pointers


def test_the_rows_fit_the_device_budget():
    from hf_nosa.serving import RequestCaches

    model = _sparse_model("llama", seed=29)
    unbounded = RequestCaches(model.config)
    assert unbounded.rows.max_rows == ServingBudget().decode_rows == 32
    cfg = unbounded.nosa_config
    full = unbounded.device_bytes(max(cfg.budget_tokens, cfg.prefill_budget_blocks * cfg.block_size))
    bounded = RequestCaches(model.config, budget=ServingBudget(device_bytes=5 * full + 1, decode_rows=8))
    assert bounded.rows.max_rows == 5
    assert RequestCaches(model.config, budget=ServingBudget(device_bytes=1)).rows.max_rows == 1


def _build(caches, request_id: str, prompt: int, new_tokens: int):
    """Admit a request and build its cache's layers as its first prompt piece would (the banks open)."""
    assert caches.admit(request_id, prompt, new_tokens)
    entry, cache = caches.cache_of(request_id)
    keys = torch.randn(1, caches.kv_heads, prompt, caches.head_dim, generator=torch.Generator().manual_seed(prompt))
    for layer in cache.layers:
        layer.lazy_initialization(keys, keys)
    return entry


def test_the_banks_hold_what_row_bytes_counts_and_no_more_than_the_device_budget():
    """A bank holds all its rows from the start, its compressed keys at a power-of-two capacity: ``row_bytes`` counts
    exactly that. Under a device budget the first request sizes the rows to what the budget holds at its length,
    and a longer request whose wider bank would not fit decodes alone on buffers of its own."""
    from hf_nosa.serving import RequestCaches

    model = _sparse_model("llama", seed=29)
    unbounded = RequestCaches(model.config)
    _build(unbounded, "a", 300, 20)
    slot, grows = unbounded.row_bytes(320)
    assert unbounded.rows.bank_bytes() == unbounded.rows.max_rows * (slot + grows) > 0
    assert unbounded.row_bytes(2000)[1] > grows  # a longer request needs a wider bank

    # the banks take at most half the budget: room there for the working sets of two short requests and a long
    # one, not for the long one's wider bank
    rows = 3
    budget = 2 * rows * (slot + grows) + 100
    assert rows * (slot + grows) + rows * unbounded.row_bytes(2000)[1] > budget
    assert rows * (slot + grows) + unbounded.device_bytes(2000) <= budget
    caches = RequestCaches(model.config, budget=ServingBudget(device_bytes=budget))
    assert caches.rows.bank_bytes() == 0  # nothing opened before a request
    assert _build(caches, "a", 300, 20).row == 0
    assert caches.rows.max_rows == rows and caches.rows.bank_bytes() == rows * (slot + grows) <= budget // 2
    in_use = caches.device_in_use()
    assert _build(caches, "b", 280, 40).row == 1  # the same banks, nothing more on the device
    assert caches.device_in_use() == in_use == caches.rows.bank_bytes()
    long = _build(caches, "long", 1900, 100)
    assert long.row is None and caches.rows.bank_bytes() == rows * (slot + grows)
    assert long.cache.layers[0].compressed.keys.shape[0] == 1  # its own buffers, not a bank's row
    # admission counts the banks (allocated whole) and the requests on buffers of their own: never over the budget
    assert caches.device_in_use() == caches.rows.bank_bytes() + long.device_bytes <= budget
    others = 0
    while caches.admit(f"long{others}", 1900, 100):
        others += 1
        assert caches.device_in_use() <= budget
    assert caches.device_in_use() + caches.device_bytes(2000) > budget  # the next one waits
    caches.release("a")
    assert caches.admitted_peak == 3 + others and len(caches.entries) == 2 + others  # the most admitted at once
    with pytest.raises(RuntimeError, match="banks are open"):
        caches.rows.limit(2)


def test_with_workload_hints_the_rows_are_sized_for_the_longest_request_expected():
    """transformers' workload hints name the longest request: the first banks open at its capacity, sized to the
    budget there, so a short first request and a long later one share them (no wider bank, no request alone)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from hf_nosa.kernels.decode.block_scores import window_capacity_for
    from hf_nosa.rules.selection import num_windows
    from hf_nosa.serving import RequestCaches

    model = _sparse_model("llama", seed=29)
    probe = RequestCaches(model.config)
    slot, grows = probe.row_bytes(320)
    wide = sum(probe.row_bytes(2000))
    budget = 2 * (2 * probe.device_bytes(320) + probe.device_bytes(2000) + 100)  # as in the test above
    rows = budget // wide  # sized for the longest request expected, the banks may take the whole budget
    assert rows >= 2 and rows < budget // (slot + grows)  # fewer rows than a short first request would give
    hints = WorkloadHints(max_prompt_length=1900, max_generated_length=100, num_requests=3)
    manager = init_continuous_batching(model, _generation_config(NEW), ContinuousBatchingConfig(max_batch_tokens=128),
                                       hints, budget=ServingBudget(device_bytes=budget))
    caches = manager.nosa_requests
    assert caches.expected_tokens == 2000
    assert _build(caches, "a", 300, 20).row == 0
    assert caches.rows.max_rows == rows and caches.rows.bank_bytes() == rows * wide <= budget
    wide_windows = window_capacity_for(num_windows(2000, caches.nosa_config))
    assert wide_windows > window_capacity_for(num_windows(320, caches.nosa_config))
    assert caches.entries["a"].cache.layers[0].compressed.keys.shape[2] == wide_windows  # its row of the wide bank
    assert _build(caches, "long", 1900, 100).row == 1  # the same banks
    assert caches.rows.bank_bytes() == rows * wide
    unhinted = init_continuous_batching(model, _generation_config(NEW), ContinuousBatchingConfig(max_batch_tokens=128))
    assert unhinted.nosa_requests.expected_tokens is None


@pytest.mark.slow
def test_a_request_beyond_the_rows_decodes_alone_interpreted(interpret, prompt_rotary_on_torch, monkeypatch):
    """Three requests on two rows: the third draws buffers of its own and decodes as a run of one beside the
    batched run of the other two; every request's tokens still equal generate alone."""
    model = _sparse_model("llama", seed=31)
    prompts = _prompts((60, 70, 80), seed=31)
    alone = [_alone(model, p)[0] for p in prompts]
    assigned = []
    assign = RowPool.assign
    monkeypatch.setattr(RowPool, "assign", lambda self: assigned.append(assign(self)) or assigned[-1])
    enable(model, budget=ServingBudget(decode_rows=2))
    try:
        out = model.generate_batch(prompts, generation_config=_generation_config(NEW),
                                   continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128),
                                   persistent_manager=True)
        runs = dict(model._cached_continuous_batching_manager.nosa_requests.decode_runs)
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert [out[f"req_{i}"].generated_tokens for i in range(len(prompts))] == alone
    assert assigned == [0, 1, None]
    assert runs.get(2, 0) > 0 and runs.get(1, 0) > 0 and 3 not in runs, runs


def test_banks_and_requests_on_their_own_buffers_stay_within_the_device_budget():
    """A stream whose first request is short (it sizes the banks) and whose later ones are longer (their wider bank
    does not fit, so they decode on buffers of their own): admission counts the banks whole and those buffers, so
    together they never exceed the device budget; the long requests wait for room, and every request finishes with
    the tokens of generate alone. (On an H100, counting each request's working set instead of the banks let the two
    reach twice the budget, and requests failed out of memory: docs/serving.md, 2026-12-08.)"""
    from hf_nosa.serving import RequestCaches

    model = _sparse_model("llama", seed=41)
    short, long = 60, 1900
    probe = RequestCaches(model.config)
    slot, grows = probe.row_bytes(short + NEW)
    rows = 2
    budget = 2 * rows * (slot + grows) + 100  # banks sized by the short request take half of it
    banks = rows * (slot + grows)
    assert banks + rows * probe.row_bytes(long + NEW)[1] > budget  # no room for a wider bank: the long ones go alone
    assert banks + probe.device_bytes(long + NEW) <= budget < banks + 3 * probe.device_bytes(long + NEW)
    prompts = _prompts((short, long, long + 10, long + 20), seed=41)
    alone = [_alone(model, p)[0] for p in prompts]
    manager = init_continuous_batching(model, _generation_config(NEW), ContinuousBatchingConfig(max_batch_tokens=128),
                                       budget=ServingBudget(device_bytes=budget))
    requests = manager.nosa_requests
    seen = []  # per step: device bytes in use, requests admitted, requests on buffers of their own

    def record(module, args, kwargs):
        entries = requests.entries.values()
        seen.append((requests.device_in_use(), len(entries), sum(e.cache is not None and e.row is None
                                                                   for e in entries)))

    hook = model.model.layers[0].self_attn.register_forward_pre_hook(record, with_kwargs=True)
    manager.start()
    results = {}
    try:
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=NEW)
            if i == 0:  # the short one opens the banks first
                _wait_for(lambda: requests.rows.banks, timeout=120)
        _wait_for(lambda: results.update({r.request_id: r for r in [manager.get_result(timeout=0.05)] if r
                                          and r.is_finished()}) or len(results) == len(prompts), timeout=600)
    finally:
        manager.stop(block=True, timeout=10)
        hook.remove()
    assert all(results[f"r{i}"].error is None for i in range(len(prompts)))
    assert [results[f"r{i}"].generated_tokens for i in range(len(prompts))] == alone
    assert all(in_use <= budget for in_use, admitted, _ in seen if admitted > 1), seen
    assert max(own for _, _, own in seen) >= 1  # some long request decoded on buffers of its own
    assert requests.rows.max_rows == rows and requests.rows.bank_bytes() == banks
