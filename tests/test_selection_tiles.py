"""The bookkeeping of benchmarks/selection_tiles.py, on CPU (the selection's torch references, a counting timer):
a row per configuration, the knobs set while it runs and restored after, errors kept as rows."""

import torch

from benchmarks import selection_tiles
from hf_nosa.kernels.train import train_select

from .conftest import small_nosa_config


def test_sweep_rows_set_and_restore_the_knobs(monkeypatch):
    monkeypatch.setattr(selection_tiles.training, "SELECTION_KERNEL", True)
    cfg = small_nosa_config()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 96, 16, generator=g), torch.randn(1, 2, 96, 16, generator=g)
    bias = torch.randn(1, 2, 96, generator=g)
    before = [getattr(train_select, name) for name in selection_tiles.SCORE_KNOBS], train_select.CHOICE_WARP_SCORES
    seen = []

    def timer(run, repeats):
        seen.append(([getattr(train_select, n) for n in selection_tiles.SCORE_KNOBS], train_select.CHOICE_WARP_SCORES))
        if train_select.CHOICE_WARP_SCORES == 7:
            raise RuntimeError("out of resources")
        run()
        return 2.0

    runs = [("default", (64, 128, 32, 4), 512), ("scores", (32, 64, 16, 8), 512), ("choice", (64, 128, 32, 4), 7)]
    rows = list(selection_tiles.sweep("iid", q, k, bias, cfg, 0.25, runs, 1, layers=16, timer=timer))
    assert seen == [([64, 128, 32, 4], 512), ([32, 64, 16, 8], 512), ([64, 128, 32, 4], 7)]
    assert [r["varied"] for r in rows] == ["default", "scores", "choice"]
    assert rows[0]["layer_ms"] == 2.0 and rows[0]["step_ms"] == 32.0
    assert rows[1]["tokens_differing_from_default"] == 0  # the torch path takes no tiles: the same blocks
    assert "error" in rows[2] and "out of resources" in rows[2]["error"]
    assert ([getattr(train_select, n) for n in selection_tiles.SCORE_KNOBS], train_select.CHOICE_WARP_SCORES) == before
