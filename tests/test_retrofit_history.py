"""The retrofit's per-step history (trainer_state.json): LM loss, alignment and distillation losses and gradient
norms, kept across a resume; what a run that diverges is read from."""

import json
import math

import pytest

from hf_nosa.training.retrofit import load_recipe, retrofit

from .test_retrofit import _write_text_data

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _recipe(**overrides):
    recipe = load_recipe("tiny")
    recipe.update(steps=4, warmup_steps=1, save_every=0, gradient_checkpointing=False, **overrides)
    return recipe


@pytest.mark.slow
def test_history_records_aux_distill_losses_and_grad_norms_and_survives_a_resume(tmp_path):
    data = _write_text_data(tmp_path / "train.jsonl", n=40)
    recipe = _recipe(eviction_loss=0.1, distill_loss=1.0, max_grad_norm=1.0)
    out = tmp_path / "run"
    retrofit(recipe, data, out, max_steps=2)
    first = json.loads((out / "trainer_state.json").read_text())
    recorded = ("aux_losses", "distill_losses", "grad_norms")
    assert all(len(first[key]) == 2 for key in ("losses", *recorded))
    assert all(math.isfinite(x) and x > 0 for key in recorded for x in first[key])
    retrofit(recipe, data, out, resume=True)
    whole = json.loads((out / "trainer_state.json").read_text())
    assert whole["step"] == 4 and all(len(whole[key]) == 4 for key in recorded)
    assert all(whole[key][:2] == first[key] for key in recorded)

    plain = tmp_path / "plain"  # no alignment or distillation loss, no clipping: nothing recorded for them
    retrofit(_recipe(eviction_loss=0.0, selection_loss=0.0, max_grad_norm=None), data, plain)
    state = json.loads((plain / "trainer_state.json").read_text())
    assert len(state["losses"]) == 4 and all(state[key] == [] for key in recorded)
