"""Self-distillation from the base model: a KL term that keeps a retrofit close to what the base model predicts.

The retrofit trains on prose and code with the LM loss; behaviour that text does not exercise (retrieving a needle,
following instructions) drifts away unchecked. With the recipe key ``distill_loss`` each micro-step adds
``distill_loss * KL(teacher || student)``, per token, where the teacher is the same model computing exactly its
base: LoRA off (PEFT's ``disable_adapter``) and every NOSA attention layer running as the stock attention class it
was converted from (dense causal attention, no eviction head, no alignment loss), in eval mode, without gradient.
No second copy of the weights is kept: the teacher pass runs through the model being trained, in its forward dtype.

The KL is computed from the two models' logits a chunk of tokens at a time, in fp32, inside one autograd function
whose backward recomputes each chunk's gradient (``softmax(student) - softmax(teacher)``) into one tensor: neither
model's fp32 log-probabilities exist for more than one chunk at a time.

Shapes: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.base import NosaAttentionMixin

# Most logits one chunk of the KL covers (2**24 fp32 = 64 MiB per copy). A chunk holds about five such fp32 copies
# (student and teacher logits upcast, their log-probabilities, the product), so the KL's peak beyond the two models'
# logits (kept in their forward dtype) is about 320 MiB, and its backward's the same plus the gradient of the
# student's logits (one tensor of their size and dtype, which the LM loss's backward needs anyway).
CHUNK_ELEMENTS = 1 << 24


def _stock_class(cls: type) -> type:
    """The stock attention class a NOSA attention class was built on (``NosaLlamaAttention`` -> ``LlamaAttention``)."""
    return next(base for base in cls.__mro__[1:] if not issubclass(base, NosaAttentionMixin))


@contextlib.contextmanager
def base_model_mode(model: nn.Module):
    """Inside the context ``model`` computes its original base model, under ``torch.no_grad()``.

    LoRA is off (``disable_adapter`` when ``model`` is a PEFT model) and every NOSA attention layer runs as its stock
    class: dense causal attention over its own projections, without the eviction bias and without computing (or
    touching) the alignment losses. The model is in eval mode inside (no dropout); classes, adapter and
    training mode are restored on the way out, also after an error.

    Args:
        model: the unwrapped model (a ``PeftModel`` or a plain NOSA model); a DDP / FSDP wrapper around it may be
            called inside the context, it runs the same modules.
    """
    from peft import PeftModel

    layers = [(m, type(m)) for m in model.modules() if isinstance(m, NosaAttentionMixin)]
    training = model.training
    adapter = model.disable_adapter() if isinstance(model, PeftModel) else contextlib.nullcontext()
    try:
        for module, cls in layers:
            module.__class__ = _stock_class(cls)
            if hasattr(module, "_old_forward"):  # accelerate's hooks call the forward they wrapped
                module._old_forward = types.MethodType(module.__class__.forward, module)
        model.eval()
        with adapter, torch.no_grad():
            yield model
    finally:
        for module, cls in layers:
            module.__class__ = cls
            if hasattr(module, "_old_forward"):
                module._old_forward = types.MethodType(cls.forward, module)
        model.train(training)


def teacher_logits(model: nn.Module, unwrapped: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` logits of the base model (``base_model_mode``) on ``input_ids`` ``[B, T]``, without gradient.

    ``model`` is what the training step calls (possibly wrapped by accelerate: autocast, DDP, FSDP), ``unwrapped``
    the PEFT model inside it.
    """
    with base_model_mode(unwrapped):
        return model(input_ids=input_ids, use_cache=False).logits


class _ChunkedKL(torch.autograd.Function):
    """Sum over tokens of KL(softmax(teacher) || softmax(student)), a chunk of rows at a time; gradient to the
    student only."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for lo in range(0, student.shape[0], rows):
            log_t = F.log_softmax(teacher[lo:lo + rows].float(), -1)
            log_s = F.log_softmax(student[lo:lo + rows].float(), -1)
            total += (log_t.exp() * (log_t - log_s)).sum()
        ctx.save_for_backward(student, teacher)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, teacher = ctx.saved_tensors
        out = torch.empty_like(student)
        for lo in range(0, student.shape[0], ctx.rows):
            # d/ds sum_v p_t (log p_t - log_softmax(s)) = softmax(s) - p_t, since p_t sums to 1
            diff = F.softmax(student[lo:lo + ctx.rows].float(), -1) - F.softmax(teacher[lo:lo + ctx.rows].float(), -1)
            out[lo:lo + ctx.rows] = (diff * grad).to(out.dtype)
        return out, None, None


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, chunk_elements: int = CHUNK_ELEMENTS
               ) -> torch.Tensor:
    """Per-token mean of KL(teacher || student) at temperature 1, over all ``B * T`` tokens; an fp32 scalar.

    Args:
        student_logits: ``[B, T, V]`` with gradient (any float dtype).
        teacher_logits: ``[B, T, V]``, no gradient flows to it.
        chunk_elements: most logits a chunk covers (``CHUNK_ELEMENTS``; at least one token's row).

    Example:
        >>> s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
        >>> ref = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum") / 10
        >>> bool(torch.allclose(distill_kl(s, t, chunk_elements=22), ref))
        True
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape [B, T, V]")
    V = student_logits.shape[-1]
    student = student_logits.reshape(-1, V)
    rows = max(1, chunk_elements // V)
    return _ChunkedKL.apply(student, teacher_logits.detach().reshape(-1, V), rows) / student.shape[0]
