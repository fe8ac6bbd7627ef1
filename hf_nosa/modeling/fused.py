"""The decoder layer's small ops on fused kernels: RMSNorm and the gated MLP's SiLU product.

``to_nosa`` swaps each stock ``*RMSNorm`` and SiLU ``*MLP`` module's class for a subclass whose forward calls one
kernel (``kernels.layers.rms_norm``, ``kernels.layers.silu_mul``) in place of the stock eight and two launches; the
rotary embedding goes through the attention's ``rotary`` (``kernels.layers.rotary``). The subclasses add no parameter
and keep every name, so state dicts, ``save_pretrained``, export and PEFT see the stock modules. The kernels run only
where no gradient is wanted, on CUDA; elsewhere the forward is the stock computation, line for line.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..kernels.layers.rms_norm import rms_norm
from ..kernels.layers.silu_mul import silu_mul
from ..rules.devices import MLP_SLICE_TOKENS  # noqa: F401 (read below as this module's name; tests patch it here)

SILU_NAMES = ("silu", "swish")


class FusedRMSNormMixin:
    """Mixed into a family's RMSNorm (``weight``, ``variance_epsilon``): the forward as one kernel."""

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class FusedMLPMixin:
    """Mixed into a family's gated MLP with SiLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, the product as
    one kernel, ``MLP_SLICE_TOKENS`` tokens at a time where no gradient is wanted."""

    def forward(self, x):
        n = x.shape[:-1].numel()
        if n <= MLP_SLICE_TOKENS or torch.is_grad_enabled():
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        rows = x.reshape(n, x.shape[-1])
        out = None
        for lo in range(0, n, MLP_SLICE_TOKENS):
            part = rows[lo:lo + MLP_SLICE_TOKENS]
            part = self.down_proj(silu_mul(self.gate_proj(part), self.up_proj(part)))
            if out is None:
                out = part.new_empty(n, part.shape[-1])
            out[lo:lo + part.shape[0]] = part
        return out.view(*x.shape[:-1], -1)


def _silu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    name = getattr(getattr(module, "config", None), "hidden_act", None)
    return name in SILU_NAMES and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")


def fuse_modules(model: nn.Module, fused_classes: dict[type, type]) -> int:
    """Swap every module whose class is exactly a key of ``fused_classes`` (stock class -> fused subclass) for its
    fused subclass, in place; an MLP only when its activation is SiLU. Returns how many were swapped (0 when the
    model is converted already)."""
    swapped = 0
    for module in model.modules():
        fused = fused_classes.get(type(module))
        if fused is None or (issubclass(fused, FusedMLPMixin) and not _silu_mlp(module)):
            continue
        module.__class__ = fused
        # accelerate's hooks call the forward they wrapped: point them at the fused forward.
        if hasattr(module, "_old_forward"):
            module._old_forward = types.MethodType(fused.forward, module)
        swapped += 1
    return swapped
