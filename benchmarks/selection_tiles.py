"""One layer's training selection (``training.selected_block_indices`` through ``kernels/train_select.py``) per
tile configuration of its two kernels, at the 1b shape: which tiles the 64K retrofit step should use.

The block-score kernel's tiles (``SCORES_ROWS``, ``SCORES_BLOCK_W``, ``SCORES_BLOCK_N``, ``SCORES_WARPS``) and the
choice kernel's ``CHOICE_WARP_SCORES`` were swept at 32K on the last 8K tokens; at 64K the selection takes 282 ms a
step (block scores 173, choice 109: ``results/train_step_breakdown_64k_sites_a66a20d.json``). Each configuration
here times the whole selection of one layer (every query chunk, as the step runs it), iid and smooth queries
(``train_step._inputs``), and counts the tokens whose blocks differ from the default configuration's (the block
scores' summation order follows the tiles, so a near-tie may resolve differently). Weights are random; CUDA only.

    python -m benchmarks train tiles --out docs/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import cuda_time_ms as time_ms  # noqa: E402
from benchmarks.train_step import SHAPES, _inputs  # noqa: E402
from hf_nosa import NosaConfig  # noqa: E402
from hf_nosa.attention import training  # noqa: E402
from hf_nosa.kernels.train import train_select  # noqa: E402
from hf_nosa.training.retrofit import load_recipe  # noqa: E402

SCORE_KNOBS = ("SCORES_ROWS", "SCORES_BLOCK_W", "SCORES_BLOCK_N", "SCORES_WARPS")
# (rows, windows, blocks, warps) tried by default; --full tries every combination of the values they take.
SCORE_CONFIGS = [(64, 128, 32, 4), (64, 128, 32, 8), (64, 64, 32, 4), (64, 256, 32, 8), (64, 128, 64, 4),
                 (64, 128, 16, 4), (32, 128, 32, 4), (32, 64, 32, 4), (128, 128, 32, 8), (128, 64, 32, 8),
                 (128, 128, 64, 8), (128, 256, 32, 8)]
CHOICE_CONFIGS = [256, 512, 1024, 2048]


def sweep(kind, q, k, bias, cfg, scale, runs, repeats, *, layers, timer=time_ms):
    """One row per ``(varied, scores, choice)`` of ``runs``: the selection of one layer under those tiles, timed by
    ``timer(run, repeats)``, and its tokens whose blocks differ from the first run's. The knobs are restored after."""
    saved = [getattr(train_select, name) for name in SCORE_KNOBS], train_select.CHOICE_WARP_SCORES

    def select():
        return training.selected_block_indices(q, k, bias, cfg, scale)

    reference = None
    try:
        for what, scores, choice in runs:
            for name, value in zip(SCORE_KNOBS, scores):
                setattr(train_select, name, value)
            train_select.CHOICE_WARP_SCORES = choice
            row = dict(inputs=kind, varied=what, scores=list(scores), choice_warp_scores=choice)
            try:
                ms = timer(select, repeats)
                chosen = select()
                reference = chosen if reference is None else reference
                row.update(layer_ms=round(ms, 3), step_ms=round(ms * layers, 1),
                           tokens_differing_from_default=int((chosen != reference).any(-1).sum()))
            except Exception as error:  # a tile the GPU cannot take (shared memory, registers) is a result too
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            yield row
    finally:
        for name, value in zip(SCORE_KNOBS, saved[0]):
            setattr(train_select, name, value)
        train_select.CHOICE_WARP_SCORES = saved[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for selection_tiles.json (rewritten after every row)")
    parser.add_argument("--length", type=int, default=65536, help="tokens of the sequence (default 65536)")
    parser.add_argument("--inputs", default="iid,smooth", help="comma-separated among iid, smooth")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="every combination of the block-score tile values")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("selection_tiles.py times CUDA kernels: it needs a GPU")
    kinds = args.inputs.split(",")
    unknown = [k for k in kinds if k not in ("iid", "smooth")]
    if unknown:
        parser.error(f"--inputs {','.join(unknown)} is not supported; allowed values are iid, smooth")
    shape, recipe_name = SHAPES["1b"]
    cfg = NosaConfig.from_dict(load_recipe(recipe_name)["nosa"])
    H, Hk, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    device, T = torch.device("cuda"), args.length
    training.SELECTION_KERNEL = True
    default_scores = tuple(getattr(train_select, k) for k in SCORE_KNOBS)
    default_choice = train_select.CHOICE_WARP_SCORES
    score_configs = SCORE_CONFIGS
    if args.full:
        values = [sorted({c[i] for c in SCORE_CONFIGS}) for i in range(4)]
        score_configs = list(itertools.product(*values))
    runs = [("scores", c, default_choice) for c in score_configs if c != default_scores]
    runs += [("choice", default_scores, w) for w in CHOICE_CONFIGS if w != default_choice]
    runs.insert(0, ("default", default_scores, default_choice))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "selection_tiles.json")
    report = dict(environment(), shape="1b", recipe=recipe_name, nosa_config=cfg.to_dict(), length=T,
                  knobs=list(SCORE_KNOBS) + ["CHOICE_WARP_SCORES"], results=[])
    for kind in kinds:
        g = torch.Generator(device=device).manual_seed(0)
        q = _inputs(kind, H, T, D, device, torch.bfloat16, g)
        k = _inputs(kind, Hk, T, D, device, torch.bfloat16, g)
        bias = 0.1 * torch.randn(1, Hk, T, device=device, generator=g)
        for row in sweep(kind, q, k, bias, cfg, D**-0.5, runs, args.repeats, layers=shape["num_hidden_layers"]):
            report["results"].append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
