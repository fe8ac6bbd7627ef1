"""The allocator setting a retrofit run takes: expandable segments on CUDA, never over the user's own setting."""

import logging

import pytest
import torch

from hf_nosa.training import allocator


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append, raising=False)
    monkeypatch.setattr(allocator, "_applied", None)
    for name in allocator.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    return seen


def test_cuda_gets_expandable_segments_when_the_user_set_nothing(calls, caplog):
    with caplog.at_level(logging.INFO, logger="hf_nosa.training.allocator"):
        assert allocator.use_expandable_segments(torch.device("cuda")) is True
    assert calls == ["expandable_segments:True"]
    assert allocator.allocator_setting() == "expandable_segments:True"
    assert "expandable_segments:True" in caplog.text


@pytest.mark.parametrize("name", allocator.ALLOCATOR_ENV)
def test_the_users_setting_is_kept(calls, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:256")
    assert allocator.use_expandable_segments(torch.device("cuda")) is False
    assert calls == []
    assert allocator.allocator_setting() == f"{name}=max_split_size_mb:256"


def test_the_cpu_is_left_alone(calls):
    assert allocator.use_expandable_segments(torch.device("cpu")) is False
    assert calls == [] and allocator.allocator_setting() == "default"


@pytest.mark.gpu
def test_segments_made_after_the_switch_are_expandable(monkeypatch):
    if allocator.user_setting():
        pytest.skip(f"the allocator is set by the environment ({allocator.user_setting()})")
    monkeypatch.setattr(allocator, "_applied", None)
    torch.randn(1024, device="cuda")  # the allocator has run before the switch, as when a model was loaded first
    try:
        assert allocator.use_expandable_segments(torch.device("cuda")) is True
        after = torch.randn(4096, 4096, device="cuda")
        segments = torch.cuda.memory._snapshot()["segments"]
        home = max((s for s in segments if s["address"] <= after.data_ptr()), key=lambda s: s["address"])
        assert home["is_expandable"]
    finally:
        allocator.set_allocator_settings("expandable_segments:False")  # the rest of the suite runs as it did
