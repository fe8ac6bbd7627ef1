"""Does the training selection's block-score kernel keep the reference's exact ties? A diagnosis, not a timing.

On the tests' tiny llama (fp32, block 16, windows 8 / 4, so a window straddling two blocks is often both blocks'
maximum), the first layer's inputs are captured from a training forward; then its query-aware block scores through
``train_block_scores`` (Triton) and ``selection.query_block_scores`` (torch), the choice of each, and how many of the
reference's exact ties between neighbouring blocks the kernel keeps. A broken tie makes the training path select
another block than decoding, whose choice breaks the tie by index.

    python -m benchmarks train ties                     # on a GPU
    TRITON_INTERPRET=1 python -m benchmarks train ties  # the same kernels interpreted, on the CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_nosa.attention.training as training  # noqa: E402
from hf_nosa.kernels.train.train_select import train_block_scores, train_select_blocks, train_select_blocks_ref  # noqa: E402
from hf_nosa.rules.selection import compress_keys, pool_windows_to_blocks, query_block_scores  # noqa: E402
from tests.test_training import _sparse_model  # noqa: E402


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    original = training.selected_block_indices

    def record(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    training.selected_block_indices = record
    model = _sparse_model("llama").to(device).train()
    ids = torch.randint(3, 97, (2, 150), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        model(ids, use_cache=False)
    training.selected_block_indices = original
    q, k, bias, cfg, scale = calls[0]  # the first layer
    ck, cb = compress_keys(k, cfg), compress_keys(bias, cfg)
    N = -(-k.shape[2] // cfg.block_size)
    positions = torch.arange(k.shape[2], device=device, dtype=torch.int32)
    static = pool_windows_to_blocks(cb.float(), N, cfg, fill=float("-inf"))

    os.environ["HF_NOSA_KERNELS"] = "torch"
    expected = query_block_scores(q, ck, positions.long(), N, cfg, scale, compressed_bias=cb)
    chosen_ref = train_select_blocks_ref(expected, cb, positions.long(), cfg, cfg.budget_blocks)
    os.environ["HF_NOSA_KERNELS"] = "triton"
    actual = train_block_scores(q, ck, positions, N, cfg, scale, compressed_bias=cb)
    chosen_on_ref = train_select_blocks(expected, cb, positions, cfg, n_blocks=N, static_scores=static)
    chosen = train_select_blocks(actual, cb, positions, cfg, n_blocks=N, static_scores=static)

    def differing(a, b):
        return int((a.long().sort(-1).values != b.long().sort(-1).values).any(-1).sum())

    ties = (expected[..., 1:] == expected[..., :-1]) & (expected[..., 1:] > 0)
    kept = (actual[..., 1:] == actual[..., :-1]) & ties
    print(f"device {device}; scores max abs diff {(actual - expected).abs().max().item():.3e}")
    print(f"choice kernel on the reference's scores: {differing(chosen_on_ref, chosen_ref)} tokens differ")
    print(f"choice kernel on the kernel's scores: {differing(chosen, chosen_ref)} tokens differ")
    print(f"neighbouring blocks' exact ties: reference {int(ties.sum())}, kept by the kernel {int(kept.sum())}")


if __name__ == "__main__":
    main()
