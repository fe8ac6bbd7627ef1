"""``backend.tuned_run`` / ``fastest_config``: which configuration a kernel launches with (no GPU needed for the
untimed choice)."""

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from hf_nosa.kernels import backend  # noqa: E402


def test_untimed_choice_is_the_first_configuration_that_fits(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []

    def run(rows, warps):
        calls.append((rows, warps))
        if rows > 64:
            raise OutOfResources(300_000, 232_448, "shared memory")

    cache = {}
    configs = [(128, 8), (64, 4), (32, 4)]
    backend.tuned_run(run, configs, cache, ("k", 64), torch.device("cpu"), "k", timed=False)
    assert calls == [(128, 8), (64, 4), (64, 4)]  # tried, chosen (compiled once), then the launch itself
    assert cache == {("k", 64): (64, 4)}
    backend.tuned_run(run, configs, cache, ("k", 64), torch.device("cpu"), "k", timed=False)
    assert calls[3:] == [(64, 4)]  # the cached choice: no other configuration compiled again
    backend.tuned_run(run, configs, cache, ("k", 64), torch.device("cpu"), "k", config=(32, 4))
    assert calls[4:] == [(32, 4)]  # an explicit configuration wins


def test_no_configuration_that_fits_names_the_kernel(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def run(*config):
        raise OutOfResources(300_000, 232_448, "shared memory")

    with pytest.raises(RuntimeError, match="my_kernel: no configuration"):
        backend.tuned_run(run, [(1,), (2,)], {}, ("k",), torch.device("cpu"), "my_kernel", timed=False)


def test_interpreter_takes_its_own_configuration(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    backend.tuned_run(lambda *c: calls.append(c), [(128, 8)], {}, ("k",), torch.device("cpu"), "k",
                      interpreter_config=(16, 1))
    assert calls == [(16, 1)]
