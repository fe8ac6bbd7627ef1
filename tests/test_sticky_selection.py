"""experiments/sticky_selection.py: NOSA's rule with a margin for last step's query-aware blocks."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from .conftest import small_nosa_config
from .test_baselines import _decode_layer

PATH = Path(__file__).resolve().parents[1] / "experiments" / "sticky_selection.py"
spec = importlib.util.spec_from_file_location("sticky_selection", PATH)
sticky = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sticky)

CFG = dict(budget_tokens=96, sink_tokens=16, local_tokens=16, query_tokens=32)


def _changes(margin: float, seed: int) -> tuple[int, list[torch.Tensor]]:
    """Blocks newly selected over the decode steps, and each step's selection."""
    cfg = small_nosa_config(**CFG)
    changed, previous, chosen = 0, None, []
    for layer, q, t, _, selection in _decode_layer(sticky.StickySelector(margin), cfg, seed=seed, steps=30):
        if previous is not None:
            for row_now, row_before in zip(selection.reshape(-1, cfg.budget_blocks).tolist(),
                                           previous.reshape(-1, cfg.budget_blocks).tolist()):
                changed += len(set(row_now) - set(row_before) - {-1})
        previous = selection
        chosen.append(selection)
    return changed, chosen


def test_margin_zero_is_the_nosa_rule():
    cfg = small_nosa_config(**CFG)
    for layer, q, t, _, chosen in _decode_layer(sticky.StickySelector(0.0), cfg, seed=3):
        reference = copy.copy(layer)
        reference.selector = None
        assert torch.equal(chosen.sort(-1).values, reference.select(q, t, 8**-0.5).sort(-1).values)


def test_a_margin_keeps_more_of_last_steps_blocks():
    # random queries make the query-aware choice change at nearly every step; a large margin holds it
    free, _ = _changes(0.0, seed=4)
    held, chosen = _changes(4.0, seed=4)
    assert free > 0 and held < free
    cfg = small_nosa_config(**CFG)
    for selection in chosen:  # still a valid selection: the budget, distinct blocks
        for row in selection.reshape(-1, cfg.budget_blocks).tolist():
            real = [b for b in row if b >= 0]
            assert len(real) == len(set(real))
