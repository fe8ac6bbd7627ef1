"""Does QUOKA prefill keep the pass key that dense prefill keeps? SmolLM2-135M-Instruct, untrained NOSA (A = 0).

Issue 16, item 6: through ``model.generate`` with a NosaCache, the default prefill ("auto": QUOKA once the prompt
outgrows the prefill budget) must find as many pass keys as dense prefill followed by the same NOSA decode, within
one prompt, at 2K and 4K tokens with budgets of 1/4 and 1/8 of the context.

Prompts are the suite's pass-key samples (``hf_nosa.eval.generate_samples("passkey")``, RULER protocol, plain
text); the layout is the evaluation's (``eval.runner.nosa_layout``: one sink block, a quarter of the budget local, a
quarter query-aware); the answer is scored by RULER's substring match on 8 greedy tokens. ``--scoring cosine`` runs
QUOKA's previous block score (cosine similarity, normalised queries averaged over the GQA group, max over the kept
queries) in place of the library's, to reproduce the "before" column; ``--dense-tail 0`` runs QUOKA without its dense
tail (``NosaConfig.prefill_dense_tail_tokens``), as it was before that; ``--only 5,12`` runs a cell's given prompts.

    python experiments/quoka_passkey.py --lengths 2048,4096 --ratios 4,8 --samples 15 --out quoka_passkey.json

CPU, fp32, 2 threads: 9-20 s a prompt at 2K-4K on an idle 2-core machine, several times that when it is shared.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hf_nosa import NosaCache, to_nosa
from hf_nosa.prefill import quoka as quoka_module
from hf_nosa.eval.runner import environment, nosa_layout
from hf_nosa.eval.tasks import generate_samples
from hf_nosa.modeling.loading import load_causal_lm
from hf_nosa.rules.selection import pool_windows_to_blocks

SCORINGS = ("library", "cosine")


def cosine_scores(kept, compressed_keys, n_windows, n_blocks, cfg, *, n_valid=None, compressed_bias=None):
    """QUOKA's block score before issue 16: max over kept queries of the cosine between the group-mean normalised
    query and the normalised compressed key, pooled to blocks (no padding handling: these prompts have none)."""
    B, H, R, n, D = kept.shape
    Hk, W = compressed_keys.shape[1], compressed_keys.shape[2]
    q = F.normalize(kept.float(), dim=-1).view(B, Hk, H // Hk, R, n, D).mean(2)
    cosine = torch.einsum("bkrnd,bkwd->bkrnw", q, F.normalize(compressed_keys.float(), dim=-1))
    if n_valid is not None:
        real = torch.arange(n) < n_valid[..., None]
        cosine = cosine.masked_fill(~real[:, None, :, :, None], float("-inf"))
    window_scores = cosine.amax(3).masked_fill(~(torch.arange(W) < n_windows[:, None]), float("-inf"))
    return pool_windows_to_blocks(window_scores, n_blocks, cfg, fill=float("-inf"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--ratios", default="4,8", help="budget = length / ratio, comma-separated")
    parser.add_argument("--prefills", default="dense,auto", help="prefill modes to compare, comma-separated")
    parser.add_argument("--samples", type=int, default=15, help="pass-key prompts per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="prompt indices to run (comma-separated), e.g. a cell's misses")
    parser.add_argument("--scoring", default="library", choices=SCORINGS,
                        help="QUOKA block score: the library's, or the previous cosine score")
    parser.add_argument("--dense-tail", type=int, default=None,
                        help="prefill_dense_tail_tokens (default: the library's); 0 gives QUOKA before the dense tail")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.scoring == "cosine":
        quoka_module.quoka_score = cosine_scores
    model, tokenizer = load_causal_lm("smollm2")
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [int(x) for x in args.ratios.split(",")]
    model = to_nosa(model, nosa_layout(None, lengths[0] // ratios[0]))
    report = {"environment": environment(), "scoring": args.scoring, "seed": args.seed, "cells": []}
    print(f"{'length':>6} {'budget':>6} {'prefill':>7} {'found':>7}  seconds")
    for length in lengths:
        samples = generate_samples("passkey", n=args.samples, length=length, tokenizer=tokenizer, seed=args.seed)
        if args.only:
            samples = [samples[int(i)] for i in args.only.split(",")]
        for ratio in ratios:
            layout = nosa_layout(None, length // ratio)
            for prefill in args.prefills.split(","):
                config = layout.replace(prefill=prefill)
                if args.dense_tail is not None:
                    config = config.replace(prefill_dense_tail_tokens=args.dense_tail)
                found, answers, start = 0, [], time.perf_counter()
                for sample in samples:
                    ids = tokenizer(sample.prompt, add_special_tokens=sample.add_special_tokens,
                                    return_tensors="pt")["input_ids"]
                    with torch.no_grad():
                        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                             do_sample=False, pad_token_id=tokenizer.pad_token_id or 0,
                                             past_key_values=NosaCache(model.config, config))
                    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                    found += sample.score(answer) == 1.0
                    answers.append({"key": sample.answers[0], "answer": answer})
                seconds = time.perf_counter() - start
                print(f"{length:>6} {length // ratio:>6} {prefill:>7} {found:>3}/{len(samples):<3}  {seconds:.0f}",
                      flush=True)
                report["cells"].append({"length": length, "budget_tokens": length // ratio, "prefill": prefill,
                                        "found": found, "samples": len(samples), "answers": answers,
                                        "config": config.to_dict()})
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
