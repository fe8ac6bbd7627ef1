"""Shared test helpers."""

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5, msg: str = ""):
    """Compare in fp32 and report the worst element."""
    actual, expected = actual.float(), expected.float()
    diff = (actual - expected).abs()
    limit = atol + rtol * expected.abs()
    if not bool((diff <= limit).all()):
        worst = int(torch.argmax(diff - limit))
        raise AssertionError(
            f"{msg} max abs diff {diff.max().item():.3e} at flat index {worst} "
            f"(actual {actual.flatten()[worst].item():.6g}, expected {expected.flatten()[worst].item():.6g})"
        )
