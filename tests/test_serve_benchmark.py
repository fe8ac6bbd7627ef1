"""benchmarks/serve.py's request-stream measurement at the CPU smoke size: the JSON holds per method and offered load
the stream's metrics, host and device memory, a saturation summary and the floor analysis; stock runs at other
``ContinuousBatchingConfig`` settings as rows of their own; the plot is drawn where matplotlib is installed."""

import importlib.util
import json

import pytest
import transformers
from packaging.version import Version

from hf_nosa.serving import MIN_TRANSFORMERS

if Version(Version(transformers.__version__).base_version) < MIN_TRANSFORMERS:
    pytest.skip(f"serving needs transformers >= {MIN_TRANSFORMERS}", allow_module_level=True)

from benchmarks.serve import (  # noqa: E402
    STOCK_KEYS, _active_requests, batching_for, main, methods_of, nosa_method, parse_stock_config, plot_stream, stock_method)

pytestmark = pytest.mark.usefixtures("one_thread")
STREAM_KEYS = ("rate", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "max_decoding",
               "max_admitted", "host_rss_bytes", "host_peak_rss_bytes", "pinned_bytes", "pinned_peak_bytes", "device_peak_bytes",
               "device_reserved_peak_bytes")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_the_smoke_stream_writes_every_field_and_the_plot(tmp_path):
    """The smoke defaults: NOSA and stock at a small paged cache (transformers would fit its CPU cache to the host's
    free memory), two offered loads; every row measured, saturation, floor and plot recorded."""
    out = tmp_path / "serve.json"
    result = main(["--smoke", "--out", str(out)])  # NOSA, and stock at 16 blocks of 32 tokens
    written = json.loads(out.read_text())
    assert written["command"] and written["date"] and written["lengths"] == result["lengths"]
    assert all(40 <= n <= 300 for n in written["lengths"]) and len(written["lengths"]) == 3
    assert [row["method"] for row in written["rows"]] == ["nosa", "stock[num_blocks=16,page_size=32]"]
    for row in written["rows"]:
        assert [r["rate"] for r in row["rates"]] == [50.0, float("inf")]
        for rate in row["rates"]:
            assert set(STREAM_KEYS) <= set(rate), set(STREAM_KEYS) - set(rate)
            assert rate["errors"] == [] and rate["generated_tokens"] == 3 * 8 and rate["output_tok_s"] > 0
            assert 1 <= rate["max_decoding"] <= 3 and rate["ttft_p50_s"] <= rate["ttft_p99_s"]
            assert 0 <= rate["max_admitted"] <= 3  # sampled while results come: a fast stream may show none
            assert rate["device_peak_bytes"] is None  # on the CPU: no device memory to report
            if rate["host_rss_bytes"] is not None:  # Linux
                assert 0 < rate["host_rss_bytes"] <= rate["host_peak_rss_bytes"]
        best = max(row["rates"], key=lambda r: r["output_tok_s"])
        assert row["saturation"]["output_tok_s"] == best["output_tok_s"]
        assert row["saturation"]["max_decoding"] == max(r["max_decoding"] for r in row["rates"])
    nosa = written["rows"][0]["rates"][-1]
    assert nosa["host_pool_bytes"] > 0 and 0.0 <= nosa["locality"] <= 1.0 and nosa["blocks_loaded"] > 0
    assert 1 <= nosa["admitted_peak"] <= 3
    # what NOSA's device side was sized to: on the CPU no device budget, the step's activations still estimated
    assert nosa["device_budget_bytes"] is None and nosa["activation_reserve_bytes"] > 0 and nosa["bank_bytes"] > 0
    # each method at its own step size: stock transformers' 8,192, NOSA that in whole chunks and a token per row
    assert written["args"]["max_batch_tokens"] is None
    assert [row["rates"][0]["batching"]["max_batch_tokens"] for row in written["rows"]] == [8192 + 32, 8192]
    # NOSA is told the longest request (as transformers serve and generate_batch tell it); stock runs at its defaults
    assert nosa["workload_hints"] == dict(max_prompt_length=max(written["lengths"]), max_generated_length=8,
                                          num_requests=3)
    assert all(r["workload_hints"] is None and r["failed_requests"] == 0 for r in written["rows"][1]["rates"])
    assert written["floor"]["locality_used"] == nosa["locality"]
    png = tmp_path / "serve.png"
    if HAS_MATPLOTLIB:
        assert written["plot"] == "serve.png" and png.stat().st_size > 0
    else:
        assert written["plot"] is None and not png.exists()


def test_admitted_requests_are_those_the_scheduler_holds_active():
    from types import SimpleNamespace

    scheduler = SimpleNamespace(active_requests={"a": 1, "b": 2}, waiting_requests={"c": 3})
    assert _active_requests(SimpleNamespace(batch_processor=SimpleNamespace(scheduler=scheduler))) == 2
    assert _active_requests(SimpleNamespace(batch_processor=None)) == 0  # before the manager's thread starts


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the plot needs matplotlib (the [bench] extra)")
def test_the_plot_draws_every_method_and_the_saturating_load(tmp_path):
    rows = [dict(method=m, rates=[dict(rate=r, output_tok_s=s, ttft_p50_s=0.1, tpot_p50_s=None) for r, s in
                                  ((0.5, 10.0), (float("inf"), 20.0))]) for m in ("stock", "nosa")]
    assert plot_stream(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0


def test_stock_settings_parse_by_type_and_refuse_unknown_keys():
    assert parse_stock_config("max_memory_percent=0.5, page_size=64,allow_block_sharing=false") == dict(
        max_memory_percent=0.5, page_size=64, allow_block_sharing=False)
    assert parse_stock_config("num_blocks=None") == dict(num_blocks=None)
    assert stock_method("page_size=64,num_blocks=128") == "stock[page_size=64,num_blocks=128]"
    args = type("Args", (), dict(max_batch_tokens=512))()
    config = batching_for("stock[page_size=64,max_batch_tokens=256]", args)
    assert (config.page_size, config.max_batch_tokens) == (64, 256)
    assert batching_for("nosa", args).max_batch_tokens == 512
    assert nosa_method("max_batch_tokens=65536") == "nosa[max_batch_tokens=65536]"
    assert batching_for("nosa[max_batch_tokens=65536]", args).max_batch_tokens == 65536
    assert batching_for("nosa-eager", args).use_cuda_graph is False
    both = type("Args", (), dict(methods="nosa,stock", stock_config=["page_size=64"],
                                 nosa_config=["max_batch_tokens=4096"]))()
    assert methods_of(both) == ["nosa", "stock", "stock[page_size=64]", "nosa[max_batch_tokens=4096]"]
    with pytest.raises(ValueError, match="K one of page_size"):
        parse_stock_config("paged_size=64")
    with pytest.raises(ValueError, match="page_size takes"):
        parse_stock_config("page_size=big")
    with pytest.raises(ValueError, match="expected K=V"):
        parse_stock_config(",")
    assert "max_memory_percent" in STOCK_KEYS and "num_blocks" in STOCK_KEYS


def test_a_128k_run_is_accepted_and_bad_arguments_refused():
    """--min / --max 131072: the prompts are that long and the shape's positions hold them with 1024 new tokens."""
    import types

    import torch

    from benchmarks.decode_throughput import build_model
    from benchmarks.serve import methods_of, prompts_of

    args = types.SimpleNamespace(seed=0, min=131072, max=131072, requests=1)
    assert [len(p) for p in prompts_of(args, 128256)] == [131072]
    model = build_model("1b", "meta", torch.bfloat16)
    assert model.config.max_position_embeddings >= 131072 + 1024
    with pytest.raises(ValueError, match="min <= max"):
        main(["--smoke", "--min", "400", "--max", "300"])
    with pytest.raises(ValueError, match="not one of stock, nosa"):
        methods_of(types.SimpleNamespace(methods="stock,vllm", stock_config=None))


def test_a_profile_window_writes_each_streams_op_table(tmp_path):
    """``--profile DIR``: a window of each method's stream under torch.profiler, the manager's thread included (its
    forward's linear layers appear in the table), named in the row."""
    out, profile = tmp_path / "serve.json", tmp_path / "profile"
    main(["--smoke", "--rates", "inf", "--out", str(out), "--profile", str(profile), "--profile-after", "0",
          "--profile-seconds", "1e9"])  # the window closes with the stream: it holds every step, however slow
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        table = row["rates"][0]["profile"]
        assert table.startswith("profile/") and table.endswith("-ops.txt")
        text = (tmp_path / table).read_text()
        assert "aten::linear" in text  # ops of the manager's thread, where the steps run
        assert (tmp_path / table.replace("-ops.txt", "-trace.json.gz")).stat().st_size > 0


def test_a_deadline_cuts_a_stream_and_counts_what_it_delivered(tmp_path, monkeypatch):
    """``--deadline S``: requests stream their tokens; a stream that ends before S is whole (every request finished,
    every token counted), one cut at S says so and counts only the tokens delivered by then."""
    whole = main(["--smoke", "--rates", "inf", "--deadline", "1e9", "--out", str(tmp_path / "a.json")])  # never met
    for row in whole["rows"]:
        rate = row["rates"][0]
        assert rate["cut_short"] is False and rate["finished_requests"] == 3 and rate["generated_tokens"] == 3 * 8
    import functools

    from transformers.generation.continuous_batching import ContinuousBatchingManager

    stops, stop = [], ContinuousBatchingManager.stop

    @functools.wraps(stop)
    def recorded_stop(self, *args, **kwargs):
        stops.append(kwargs.get("hard_stop", False))
        return stop(self, *args, **kwargs)

    monkeypatch.setattr(ContinuousBatchingManager, "stop", recorded_stop)
    cut = main(["--smoke", "--rates", "inf", "--deadline", "0", "--out", str(tmp_path / "b.json")])
    for row in cut["rows"]:
        rate = row["rates"][0]
        assert rate["cut_short"] is True and rate["finished_requests"] < 3 and rate["generated_tokens"] < 3 * 8
    # a plain stop would wait for every request to finish: a cut stream stops hard (the warm-up's stop flushes)
    assert stops and stops[-1] is True


def test_stock_is_sized_to_the_cap_not_to_the_cards_free_memory(monkeypatch):
    """transformers sizes stock's paged cache as max_memory_percent of mem_get_info's free memory, which a
    per-process fraction does not lower: under a cap the benchmark passes the same share of what the cap leaves."""
    import argparse

    import torch

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (76 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)

    def fraction(device=None):  # as torch's: None is the current device, "cuda" without an index is refused
        if isinstance(device, (str, torch.device)) and torch.device(device).index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return 0.3  # 24 of 80 GiB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    args = argparse.Namespace(max_batch_tokens=8192)
    assert batching_for("stock", args).max_memory_percent == pytest.approx(0.9 * 21 / 76)
    assert batching_for("stock[max_memory_percent=0.5]", args).max_memory_percent == pytest.approx(0.5 * 21 / 76)
    assert batching_for("nosa", args).max_memory_percent is None  # NOSA's manager sizes its own ledger
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)  # no cap
    assert batching_for("stock", args).max_memory_percent is None  # transformers' own default


def test_nosa_takes_the_serving_budget_given_on_the_command_line():
    """``--decode-rows`` and ``--device-budget-gb`` reach NOSA's ``ServingBudget`` (left out, the library's)."""
    import types

    import torch

    from benchmarks.serve import model_for

    def budget_of(**given):
        args = types.SimpleNamespace(**{**dict(shape="smoke", budget_tokens=64, decode_rows=None,
                                               device_budget_gb=None), **given})
        model = model_for("nosa", args, torch.device("cpu"), torch.float32)
        manager = model.init_continuous_batching()
        return manager.nosa_requests.budget

    default = budget_of()
    assert (default.decode_rows, default.device_bytes) == (32, None)  # no device budget on the CPU
    given = budget_of(decode_rows=5, device_budget_gb=0.25)
    assert (given.decode_rows, given.device_bytes) == (5, 250_000_000)
