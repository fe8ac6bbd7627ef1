"""The retrofit's per-step history (trainer_state.json): LM loss, alignment losses and gradient norms, kept across
a resume; what a run that diverges is read from."""

import json
import math

import torch

from hf_nosa.retrofit import load_recipe, retrofit

from .test_retrofit import _write_text_data


def _recipe(**overrides):
    recipe = load_recipe("tiny")
    recipe.update(steps=4, warmup_steps=1, save_every=0, gradient_checkpointing=False, **overrides)
    return recipe


def test_history_records_aux_losses_and_grad_norms_and_survives_a_resume(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = _write_text_data(tmp_path / "train.jsonl", n=40)
        recipe = _recipe(eviction_loss=0.1, max_grad_norm=1.0)
        out = tmp_path / "run"
        retrofit(recipe, data, out, max_steps=2)
        first = json.loads((out / "trainer_state.json").read_text())
        assert len(first["losses"]) == len(first["aux_losses"]) == len(first["grad_norms"]) == 2
        assert all(math.isfinite(x) and x > 0 for x in first["aux_losses"] + first["grad_norms"])
        retrofit(recipe, data, out, resume=True)
        whole = json.loads((out / "trainer_state.json").read_text())
        assert whole["step"] == 4 and len(whole["aux_losses"]) == len(whole["grad_norms"]) == 4
        assert whole["aux_losses"][:2] == first["aux_losses"] and whole["grad_norms"][:2] == first["grad_norms"]

        plain = tmp_path / "plain"  # no alignment loss, no clipping: nothing recorded for them
        retrofit(_recipe(eviction_loss=0.0, selection_loss=0.0, max_grad_norm=None), data, plain)
        state = json.loads((plain / "trainer_state.json").read_text())
        assert len(state["losses"]) == 4 and state["aux_losses"] == [] and state["grad_norms"] == []
    finally:
        torch.set_num_threads(threads)
