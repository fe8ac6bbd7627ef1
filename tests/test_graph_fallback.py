"""Decoding without a CUDA graph: selector caches are never captured, a failed capture leaves the process usable,
and a model whose capture failed decodes every later cache eagerly at once."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.eval.baselines import BASELINES, make_selector
from hf_nosa.modeling.cuda_graph import DecodeGraph, cache_keyword, stock_forward
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model

chunked = importlib.import_module("hf_nosa.modeling.chunked")
GRAPH_ENV = chunked.GRAPH_ENV_VAR
LOGGER = "hf_nosa.modeling.chunked"


def _model(seed: int, cfg):
    model = to_nosa(tiny_model("llama", seed=seed), cfg)
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 100))
    return model


def _prompt(B: int, T: int, seed: int = 0, device="cpu") -> torch.Tensor:
    return torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


@torch.no_grad()
def _greedy(model, cache, ids, steps: int) -> torch.Tensor:
    """``[B, steps]`` greedy tokens after ``ids`` (a prompt, or the last token not yet fed): plain model() calls one
    token at a time with positions, a mask and logits_to_keep=1, as ``hf_nosa.eval`` makes them."""
    out = []
    for _ in range(steps):
        t = cache.get_seq_length()
        B, T = ids.shape
        pos = torch.arange(t, t + T, device=ids.device).expand(B, T)
        mask = torch.ones(B, t + T, dtype=torch.long, device=ids.device)
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos, attention_mask=mask,
                       logits_to_keep=1).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)
        out.append(ids)
    return torch.cat(out, 1)


def _eager(model, make_cache, ids, steps, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv(GRAPH_ENV, "0")
        return _greedy(model, make_cache(), ids, steps)


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


@pytest.fixture
def graph_env(monkeypatch):
    """The graph path switched on (as on CUDA by default) and the once-per-process log memory empty."""
    monkeypatch.delenv(GRAPH_ENV, raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    monkeypatch.setattr(chunked, "_logged", set())


# ----- CPU: the bookkeeping, with the CUDA requirement and the graph replaced -----


class _EagerGraph:
    """Stands in for DecodeGraph on the CPU: the stock decode step, with every construction recorded."""

    made: list = []

    def __init__(self, model, cache):
        self.model, self.cache, self.capturing_failed = model, cache, None
        type(self).made.append(cache)

    def __call__(self, input_ids, position_ids):
        with stock_forward():
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                             **{cache_keyword(self.model): self.cache})
        return out.logits[:, -1]


class _FailingGraph(_EagerGraph):
    """A DecodeGraph whose capture fails the way an invalidated capture does."""

    def __call__(self, input_ids, position_ids):
        self.capturing_failed = RuntimeError("operation failed due to a previous error during capture")
        raise self.capturing_failed


@pytest.fixture
def cpu_graph_path(monkeypatch, graph_env):
    """On the CPU, make a decode step graph-eligible as a CUDA one is, so the bookkeeping around it runs."""
    monkeypatch.setattr(chunked, "_graph_device", lambda inputs: True)

    def use(graph_cls):
        graph_cls.made = []
        monkeypatch.setattr(chunked, "DecodeGraph", graph_cls)
        return graph_cls.made

    return use


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_selector_cache_decodes_eagerly_without_a_graph_and_says_so_once(name, cpu_graph_path, monkeypatch, caplog):
    made = cpu_graph_path(_EagerGraph)
    cfg = small_nosa_config(budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16)
    model = _model(1, cfg)
    ids = _prompt(2, 90, seed=2)
    make = lambda: NosaCache(model.config, cfg, selector=make_selector(name))  # noqa: E731
    reference = _eager(model, make, ids, 8, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):  # two caches: the reason is logged for the first only
            assert torch.equal(_greedy(model, make(), ids, 8), reference)
    assert made == []
    said = _warnings(caplog, "decodes eagerly, without a CUDA graph")
    assert len(said) == 1 and type(make_selector(name)).__name__ in said[0]
    # the same model with a NOSA cache does take the graph path here, so the assertions above can fail
    plain = NosaCache(model.config, cfg)
    _greedy(model, plain, ids, 3)
    assert made == [plain]


def test_failed_capture_makes_the_model_decode_every_later_cache_eagerly(cpu_graph_path, monkeypatch, caplog):
    made = cpu_graph_path(_FailingGraph)
    cfg = small_nosa_config()
    model = _model(3, cfg)
    ids = _prompt(2, 70, seed=4)
    make = lambda: NosaCache(model.config, cfg)  # noqa: E731
    reference = _eager(model, make, ids, 8, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first, second = make(), make()
        assert torch.equal(_greedy(model, first, ids, 8), reference)  # falls back on the step whose capture failed
        assert torch.equal(_greedy(model, second, ids, 8), reference)
    assert made == [first]  # the second cache never tried
    assert "previous error during capture" in model.forward.capture_failed
    said = _warnings(caplog, "capturing a CUDA graph failed")
    assert len(said) == 1 and "every cache" in said[0] and "previous error during capture" in said[0]
    # the failure belongs to that model: another one still tries its own capture
    other = _model(5, cfg)
    _greedy(other, NosaCache(other.config, cfg), ids, 3)
    assert len(made) == 2 and other.forward.capture_failed is not None


def test_an_error_that_is_not_a_capture_failure_propagates(cpu_graph_path):
    class BrokenGraph(_EagerGraph):
        def __call__(self, input_ids, position_ids):
            raise RuntimeError("a bug in the decode step")

    cpu_graph_path(BrokenGraph)
    cfg = small_nosa_config()
    model = _model(6, cfg)
    with pytest.raises(RuntimeError, match="a bug in the decode step"):
        _greedy(model, NosaCache(model.config, cfg), _prompt(1, 40), 3)
    assert model.forward.capture_failed is None


def test_graph_path_needs_inference_mode_calls(cpu_graph_path):
    """The other conditions still decide before the cache is looked at: grad enabled or training means eager."""
    made = cpu_graph_path(_EagerGraph)
    cfg = small_nosa_config()
    model = _model(7, cfg)
    ids = _prompt(1, 40)
    cache = NosaCache(model.config, cfg)
    model(input_ids=ids, past_key_values=cache)  # prefill (grad enabled: fine)
    step = ids[:, -1:]
    model(input_ids=step, past_key_values=cache)  # grad enabled: eager
    model.train()
    with torch.no_grad():
        model(input_ids=step, past_key_values=cache)  # training: eager
    assert made == []
    model.eval()
    with torch.no_grad():
        model(input_ids=step, past_key_values=cache)
    assert made == [cache]


# ----- GPU: real captures -----

def _counting_graphs(monkeypatch) -> list:
    made = []

    class Counting(DecodeGraph):
        def __init__(self, model, cache):
            super().__init__(model, cache)
            made.append(self)

    monkeypatch.setattr(chunked, "DecodeGraph", Counting)
    return made


def _gpu_setup(seed: int):
    cfg = small_nosa_config(prefill_chunk_size=64, prefill_budget_tokens=64)
    return _model(seed, cfg).cuda(), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.usefixtures("graph_env")
def test_gpu_selector_cache_is_not_captured_and_equals_eager(name, monkeypatch, caplog):
    made = _counting_graphs(monkeypatch)
    model, cfg = _gpu_setup(11)
    ids = _prompt(2, 200, seed=12, device="cuda")
    make = lambda: NosaCache(model.config, cfg, selector=make_selector(name))  # noqa: E731
    reference = _eager(model, make, ids, 24, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert torch.equal(_greedy(model, make(), ids, 24), reference)
        assert torch.equal(_greedy(model, make(), ids, 24), reference)
    assert made == []
    assert len(_warnings(caplog, "decodes eagerly, without a CUDA graph")) == 1
    assert not _warnings(caplog, "capturing a CUDA graph failed")
    _greedy(model, NosaCache(model.config, cfg), ids, 8)  # a NOSA cache on this device does capture
    assert len(made) == 1 and made[0].captures >= 1


def _sabotage(model, how: str) -> None:
    """Make the model's decode forward break a capture (only while capturing): "copy" copies a pageable host
    tensor to the device (torch refuses it; the capture then ends normally), "sync" synchronises the capturing
    stream (CUDA invalidates the capture, and torch's capture_end throws)."""

    def hook(module, args):
        if torch.cuda.is_current_stream_capturing():
            if how == "copy":
                torch.ones(4).to("cuda")
            else:
                torch.cuda.current_stream().synchronize()

    model.lm_head.register_forward_pre_hook(hook)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", ["copy", "sync"])
@pytest.mark.usefixtures("graph_env")
def test_gpu_failed_capture_falls_back_and_leaves_the_process_usable(how, monkeypatch, caplog):
    made = _counting_graphs(monkeypatch)
    healthy, cfg = _gpu_setup(21)
    broken, _ = _gpu_setup(22)
    ids = _prompt(2, 200, seed=23, device="cuda")
    healthy_ref = _eager(healthy, lambda: NosaCache(healthy.config, cfg), ids, 30, monkeypatch)
    broken_ref = _eager(broken, lambda: NosaCache(broken.config, cfg), ids, 20, monkeypatch)

    # a healthy model captures a graph first; it must still replay after the other model's capture failed
    healthy_cache = NosaCache(healthy.config, cfg)
    head = _greedy(healthy, healthy_cache, ids, 15)
    assert len(made) == 1 and made[0].captures >= 1
    replays = made[0].replays

    _sabotage(broken, how)
    torch.cuda.synchronize()
    rng = torch.cuda.get_rng_state()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert torch.equal(_greedy(broken, NosaCache(broken.config, cfg), ids, 20), broken_ref)
    assert len(made) == 2 and made[1].captures == 0 and made[1].capturing_failed is not None
    assert broken.forward.capture_failed is not None
    assert len(_warnings(caplog, "capturing a CUDA graph failed")) == 1

    # the process is usable: no stream left capturing, the caller's stream back, random ops and new modules work,
    # the generator kept its seed and offset (nothing here draws random numbers)
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert torch.rand(3, device="cuda").shape == (3,)
    layer = torch.nn.Linear(4, 4, device="cuda")
    assert torch.isfinite(layer(torch.ones(2, 4, device="cuda"))).all()

    # graphs still capture and replay, random ops inside them included
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x + torch.rand(4, device="cuda")
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y)

    # the healthy model's graph, captured before the failure, still replays and decodes what eager decoding does
    assert torch.equal(torch.cat([head, _greedy(healthy, healthy_cache, head[:, -1:], 15)], 1), healthy_ref)
    assert made[0].replays > replays

    # a second cache of the broken model does not try again
    assert torch.equal(_greedy(broken, NosaCache(broken.config, cfg), ids, 20), broken_ref)
    assert len(made) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("graph_env")
def test_gpu_capture_failure_names_the_host_syncs_of_the_eager_step(monkeypatch, caplog):
    """A decode forward that reads a device value on the host (``.item()``) every step cannot be captured; the
    logged reason names where the eager step before the capture synchronised, and decoding goes on eagerly."""
    model, cfg = _gpu_setup(31)
    ids = _prompt(2, 200, seed=32, device="cuda")
    reference = _eager(model, lambda: NosaCache(model.config, cfg), ids, 12, monkeypatch)

    def hook(module, args):
        args[0].sum().item()  # a host sync, captured or not

    model.lm_head.register_forward_pre_hook(hook)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert torch.equal(_greedy(model, NosaCache(model.config, cfg), ids, 12), reference)
    (message,) = _warnings(caplog, "capturing a CUDA graph failed")
    assert "synchronised with the host at" in message and "test_graph_fallback.py" in message, message
    assert not torch.cuda.is_current_stream_capturing()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_kernel_variants_counts_a_new_specialisation():
    """What a failed capture's message relies on to say that Triton compiled during the capture."""
    from hf_nosa.cache.host_store import HostStore
    from hf_nosa.modeling.cuda_graph import compiled_kernel_variants
    from hf_nosa.kernels.prefill.host_read import read_span

    before = compiled_kernel_variants()
    assert before >= 0
    host = HostStore(1, 1, 48, torch.float16, 16, pin=True)  # a head size no other test reads with
    host.write(0, torch.randn(1, 1, 40, 48).half(), torch.randn(1, 1, 40, 48).half(), torch.randn(1, 1, 40))
    read_span(host, 0, 40, "cuda")
    torch.cuda.synchronize()
    assert compiled_kernel_variants() > before
