"""A continuous-batching step's activations beside NOSA's device budget: the estimate
(``rules.devices.step_activation_bytes``) against what a served step allocates, the default device budget that leaves
them free, and a step too large for the device refused before any request (``ServingBudget.resolved``)."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig

from hf_nosa.serving import MIN_TRANSFORMERS

if Version(Version(transformers.__version__).base_version) < MIN_TRANSFORMERS:
    pytest.skip(f"serving needs transformers >= {MIN_TRANSFORMERS}", allow_module_level=True)

from hf_nosa import to_nosa  # noqa: E402
from hf_nosa.rules.devices import MLP_SLICE_TOKENS, step_activation_bytes  # noqa: E402
from hf_nosa.serving import RequestCaches, ServingBudget, enable, init_continuous_batching  # noqa: E402
from hf_nosa.serving import requests as requests_module  # noqa: E402

from .conftest import SPARSE, small_nosa_config, tiny_model  # noqa: E402
from .test_serving import _generation_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
WIDE = dict(hidden_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)


def _wide_model(chunk=128):
    """A tiny Llama whose MLP is four times its hidden size, as in the 1b shape, so the MLP term shows."""
    return to_nosa(tiny_model("llama", seed=5, **WIDE), small_nosa_config(**SPARSE, prefill_chunk_size=chunk))


def test_the_estimate_counts_tokens_the_mlp_slice_and_the_logits():
    config = tiny_model("llama", **WIDE).config
    one = step_activation_bytes(config, 1, 2, 0)
    # linear in tokens up to the MLP's slice, then the MLP term stops growing
    assert step_activation_bytes(config, 1000, 2, 0) == 1000 * one
    mlp = 3 * config.intermediate_size * 2
    beyond = step_activation_bytes(config, MLP_SLICE_TOKENS + 10, 2, 0)
    assert beyond == (MLP_SLICE_TOKENS + 10) * one - 10 * mlp
    # fp32 logits per row, whatever the activations' dtype
    rows = step_activation_bytes(config, 64, 2, 8) - step_activation_bytes(config, 64, 2, 0)
    assert rows == 8 * (config.hidden_size * 2 + config.vocab_size * 4)
    assert step_activation_bytes(config, 64, 4, 0) == 2 * step_activation_bytes(config, 64, 2, 0)


def test_the_estimate_bounds_what_a_served_prompt_step_allocates():
    """One request of 1,024 tokens in 256-token pieces: the steps that continue its prompt (its cache built, so
    what they allocate is the step's activations) allocate within 10% of the estimate (the torch references' QUOKA
    attention takes widened copies the device kernels do not) and not less than half of it, counted storage by
    storage on the CPU (``benchmarks.memory_census.StorageTracker``; the host store's own apart)."""
    from benchmarks.memory_census import StorageTracker, package_roots, replay

    model = _wide_model()
    roots, steps = package_roots(), []
    forward = model.forward

    def counted(*args, **kwargs):
        tracker = StorageTracker(roots)
        with tracker:
            out = forward(*args, **kwargs)
        tracker.recording = False
        steps.append((kwargs["input_ids"].shape[-1], replay(tracker.events)[0].bytes))
        return out

    model.forward = counted
    enable(model)
    prompt = torch.randint(3, WIDE["vocab_size"], (1024,), generator=torch.Generator().manual_seed(5)).tolist()
    model.generate_batch([prompt], generation_config=_generation_config(2),
                         continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=256))
    assert [tokens for tokens, _ in steps] == [256, 256, 256, 256, 1], steps
    for tokens, peak in steps[1:4]:  # the first piece builds the request's cache (slot pool, banks): left out
        estimate = step_activation_bytes(model.config, tokens, 4, 1)
        assert estimate / 2 <= peak <= 1.1 * estimate, (peak, estimate)
    assert steps[0][1] > 1.5 * step_activation_bytes(model.config, 256, 4, 1)  # the census does see the banks


def _on_cuda(monkeypatch, available: int):
    """RequestCaches on a CUDA device that has ``available`` bytes (no CUDA needed: nothing is allocated)."""
    monkeypatch.setattr(requests_module, "available_device_memory", lambda device: available)


def test_the_default_device_budget_leaves_a_steps_activations_free(monkeypatch):
    config = _wide_model().config
    reserve = requests_module.ACTIVATION_HEADROOM * step_activation_bytes(config, 8192, 4, 16)
    _on_cuda(monkeypatch, 100 * reserve)  # plenty: half of what is free, as before
    caches = RequestCaches(config, device="cuda", step_tokens=8192, step_requests=16)
    assert caches.step_bytes == reserve
    assert caches.budget.device_bytes == 50 * reserve
    _on_cuda(monkeypatch, 3 * reserve // 2)  # activations take more than half: the budget is what is left
    caches = RequestCaches(config, device="cuda", step_tokens=8192, step_requests=16)
    assert caches.budget.device_bytes == 3 * reserve // 2 - reserve
    # without a step size (RequestCaches alone) nothing is kept back; on the CPU there is no device budget
    assert RequestCaches(config, device="cuda").budget.device_bytes == 3 * reserve // 4
    assert RequestCaches(config, step_tokens=8192).budget.device_bytes is None
    # the logits' rows: max_requests_per_batch when set, at most transformers' 1,024
    assert RequestCaches(config, step_tokens=8192).step_bytes == requests_module.ACTIVATION_HEADROOM * (
        step_activation_bytes(config, 8192, 4, requests_module.MAX_LOGIT_ROWS))


def test_a_step_too_large_for_the_device_is_refused_naming_max_batch_tokens(monkeypatch):
    config = _wide_model().config
    reserve = requests_module.ACTIVATION_HEADROOM * step_activation_bytes(config, 4096, 4, 1)
    _on_cuda(monkeypatch, reserve)
    with pytest.raises(ValueError, match=r"max_batch_tokens=4096 .*Lower max_batch_tokens"):
        RequestCaches(config, device="cuda", step_tokens=4096, step_requests=1)
    # a device budget set beside the activations must fit with them
    _on_cuda(monkeypatch, 2 * reserve)
    with pytest.raises(ValueError, match=r"ServingBudget.device_bytes=.* plus the activations .*max_batch_tokens=4096"):
        RequestCaches(config, budget=ServingBudget(device_bytes=reserve + 1), device="cuda", step_tokens=4096,
                      step_requests=1)
    fits = RequestCaches(config, budget=ServingBudget(device_bytes=reserve), device="cuda", step_tokens=4096,
                         step_requests=1)
    assert fits.budget.device_bytes == reserve


def test_the_manager_sizes_the_budget_for_its_max_batch_tokens():
    model = _wide_model()
    manager = init_continuous_batching(model, _generation_config(2),
                                       ContinuousBatchingConfig(max_batch_tokens=384, max_requests_per_batch=3))
    assert (manager.nosa_requests.step_tokens, manager.nosa_requests.step_requests) == (384, 3)
    default = init_continuous_batching(_wide_model(), _generation_config(2))
    # unset: transformers' 8,192 in whole chunks and a token per decode row (tests/test_serving.py)
    assert default.nosa_requests.step_tokens == default.continuous_batching_config.max_batch_tokens == 8192 + 32
