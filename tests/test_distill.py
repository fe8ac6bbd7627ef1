"""Self-distillation from the base model (hf_nosa.training.distill): the teacher pass is the original model, the chunked KL
equals the direct one, its gradient reaches LoRA only, and the retrofit records it beside the alignment losses."""

import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from hf_nosa import to_nosa
from hf_nosa.training.distill import base_model_mode, distill_kl, teacher_logits
from hf_nosa.modeling import randomize_eviction_heads
from hf_nosa.modeling.base import NosaAttentionMixin
from hf_nosa.training.retrofit import load_recipe, retrofit
from hf_nosa.attention.selection_loss import enable_selection_loss

from .conftest import small_nosa_config, tiny_model
from .test_retrofit import _write_text_data


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _student(base, *, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """The retrofit's model on a copy of ``base``: NOSA attention, LoRA (B = 0), eviction heads at A = 0."""
    model = to_nosa(copy.deepcopy(base), small_nosa_config(prefill="nosa"))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets),
                        modules_to_save=["eviction_head"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config).train()


@torch.no_grad()
def _perturb(peft_model, seed=0):
    """Nonzero LoRA B (and A) and eviction heads: the student then differs from the base."""
    g = torch.Generator().manual_seed(seed)
    randomize_eviction_heads(peft_model.get_base_model(), generator=g)
    for name, param in peft_model.named_parameters():
        if "lora_" in name or ".eviction_head." in name:
            param.add_(torch.randn(param.shape, generator=g) * 0.5)


def _ids(length=100, vocab=97, seed=0):
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _reference_kl(student, teacher):
    V = student.shape[-1]
    log_s = F.log_softmax(student.float().reshape(-1, V), -1)
    return F.kl_div(log_s, F.log_softmax(teacher.float().reshape(-1, V), -1), log_target=True, reduction="batchmean")


def test_teacher_pass_is_the_original_model_after_training_changed_the_student(family):
    base = tiny_model(family)
    ids = _ids(length=200)  # 13 blocks of 16, 8 in the budget: the student's attention is sparse
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    student = _student(base)
    _perturb(student)
    enable_selection_loss(student, 0.1, eviction_weight=0.1)
    layers = [m for m in student.modules() if isinstance(m, NosaAttentionMixin)]
    classes = [type(m) for m in layers]
    got = teacher_logits(student, student, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not got.requires_grad
    # the context left nothing behind: NOSA classes, training mode, no alignment loss from the teacher pass
    assert [type(m) for m in layers] == classes and student.training
    assert all(m.last_selection_loss is None for m in layers)
    with torch.no_grad():
        changed = student(input_ids=ids).logits
    assert (changed - expected).abs().max() > 1e-2  # the student itself is not the base any more
    assert all(m.last_selection_loss is not None for m in layers)


def test_base_model_mode_restores_the_model_after_an_error():
    student = _student(tiny_model())
    classes = [type(m) for m in student.modules()]
    with pytest.raises(RuntimeError, match="inside"):
        with base_model_mode(student):
            assert not student.training and not any(isinstance(m, NosaAttentionMixin) for m in student.modules())
            raise RuntimeError("inside")
    assert [type(m) for m in student.modules()] == classes and student.training
    assert all(m.active_adapters == ["default"] for m in student.modules() if hasattr(m, "lora_A"))


def test_kl_is_zero_for_the_fresh_student_and_positive_once_it_changed():
    base = tiny_model()
    student = _student(base)
    ids = _ids(length=64)  # within the budget (128): the NOSA rule attends to every key, like the base
    fresh = distill_kl(student(input_ids=ids).logits, teacher_logits(student, student, ids))
    assert abs(fresh.item()) < 1e-6
    _perturb(student)
    changed = distill_kl(student(input_ids=ids).logits, teacher_logits(student, student, ids))
    assert changed.item() > 1e-3


@pytest.mark.parametrize("chunk_elements", [1, 97 * 7, 97 * 50, 1 << 24])
def test_chunked_kl_and_its_gradient_equal_the_direct_kl(chunk_elements):
    g = torch.Generator().manual_seed(1)
    student = (torch.randn(3, 33, 97, generator=g) * 3).requires_grad_()
    teacher = torch.randn(3, 33, 97, generator=g) * 3
    ref_student = student.detach().clone().requires_grad_()
    got = distill_kl(student, teacher, chunk_elements=chunk_elements)
    ref = _reference_kl(ref_student, teacher)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    (got * 2.5).backward()
    (ref * 2.5).backward()
    torch.testing.assert_close(student.grad, ref_student.grad, rtol=1e-5, atol=1e-7)


def test_chunked_kl_of_bf16_logits_computes_in_fp32():
    g = torch.Generator().manual_seed(2)
    student = (torch.randn(2, 20, 50, generator=g) * 4).bfloat16().requires_grad_()
    teacher = (torch.randn(2, 20, 50, generator=g) * 4).bfloat16()
    got = distill_kl(student, teacher, chunk_elements=50 * 3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference_kl(student.detach(), teacher), rtol=1e-5, atol=1e-6)
    got.backward()
    assert student.grad.dtype == torch.bfloat16 and student.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="same shape"):
        distill_kl(student, teacher[:, :10])


def test_distillation_gradient_reaches_lora_and_the_eviction_heads_never_the_teacher():
    base = tiny_model()
    student = _student(base)
    _perturb(student)
    ids = _ids()
    teacher = teacher_logits(student, student, ids)
    teacher.requires_grad_()  # were any gradient to flow to the teacher, it would land here
    distill_kl(student(input_ids=ids).logits, teacher).backward()
    assert teacher.grad is None
    grads = {name: p.grad for name, p in student.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in grads) and any("lora_B" in n for n in grads)
    for name, grad in grads.items():
        if "lora_" in name:
            assert grad is not None and grad.abs().sum() > 0, name
    assert any(".eviction_head." in n and g is not None and g.abs().sum() > 0 for n, g in grads.items())
    assert all(p.grad is None for p in student.parameters() if not p.requires_grad)


@pytest.mark.parametrize("value", [-1, "x"])
def test_recipe_rejects_a_bad_distill_loss(value):
    recipe = load_recipe("tiny")
    assert recipe["distill_loss"] == 0.0
    with pytest.raises(ValueError, match="distill_loss"):
        load_recipe({**recipe, "distill_loss": value})


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_retrofit_with_gradient_checkpointing_records_distill_losses_only_when_weighted(tmp_path, weight):
    data = _write_text_data(tmp_path / "train.jsonl", n=40)
    recipe = load_recipe("tiny")
    recipe.update(steps=2, warmup_steps=1, save_every=0, distill_loss=weight)
    assert recipe["gradient_checkpointing"]
    retrofit(recipe, data, tmp_path / "run")
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert len(state["losses"]) == 2 and len(state["distill_losses"]) == (2 if weight else 0)
    assert all(math.isfinite(x) and x > 0 for x in state["distill_losses"])


def test_a_checkpoint_written_before_distill_loss_existed_resumes(tmp_path):
    data = _write_text_data(tmp_path / "train.jsonl", n=40)
    recipe = load_recipe("tiny")
    recipe.update(steps=2, warmup_steps=1, save_every=0, gradient_checkpointing=False)
    out = tmp_path / "run"
    retrofit(recipe, data, out, max_steps=1)
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["recipe"]["distill_loss"], state["distill_losses"]  # as an older version wrote it
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    retrofit(recipe, data, out, resume=True)
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 2
    with pytest.raises(ValueError, match="distill_loss"):  # a real change of the key is still refused
        retrofit({**recipe, "distill_loss": 1.0}, data, out, resume=True)
