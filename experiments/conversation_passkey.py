"""A pass key given in turn 1, asked in turn 2 on the reused NosaCache: found as often as when the same conversation
is sent as one prompt? SmolLM2-135M-Instruct with the shipped retrofit adapter (``hf_nosa.cli.demo.load_smollm2``: its
layout, a budget of 1/8 of 8K), CPU, fp32.

Per pass-key sample (``hf_nosa.eval.generate_samples("passkey")``, RULER protocol, ``--length`` tokens):

- turn 1: the haystack holding the key (the sample's prompt up to its question), answered with ``--answer`` greedy
  tokens;
- turn 2, on the same cache: ``--filler`` more tokens of the same noise sentences (so the turn is prefilled by QUOKA
  from the cache's length, not by the decode rule of a few tokens), then the question; 8 greedy tokens scored by
  RULER's substring match;
- "one prompt": the same token ids (turn 1, its answer, turn 2) on a fresh cache;
- "original": the sample's own prompt (haystack + question) on a fresh cache.

    PYTHONPATH=. python experiments/conversation_passkey.py --length 7936 --filler 200 --samples 15 \
        --out docs/results/conversation_passkey.json

At 7936 tokens the whole conversation (turn 1, its answer, turn 2) stays within SmolLM2's 8192 positions.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from hf_nosa import NosaCache
from hf_nosa.cli.demo import load_smollm2
from hf_nosa.eval.runner import environment
from hf_nosa.eval.tasks import generate_samples

QUESTION = "\nWhat is the pass key?"
NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _greedy(model, ids, cache, new_tokens, pad):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad, past_key_values=cache)


def run_sample(model, tokenizer, sample, args) -> dict:
    pad = tokenizer.pad_token_id or 0
    cut = sample.prompt.rindex(QUESTION)
    haystack, question = sample.prompt[:cut], sample.prompt[cut:]

    def encode(text, special):
        return tokenizer(text, add_special_tokens=special, return_tensors="pt")["input_ids"]

    turn1 = encode(haystack, sample.add_special_tokens)
    cache = NosaCache(model.config)
    answered = _greedy(model, turn1, cache, args.answer, pad)
    filler = encode(NOISE * (args.filler // 20 + 1), False)[:, : args.filler]
    turn2 = torch.cat([answered, filler, encode(question, False)], 1)
    turn_tokens = turn2.shape[1] - cache.get_seq_length()
    out = _greedy(model, turn2, cache, 8, pad)
    reused = tokenizer.decode(out[0, turn2.shape[1]:], skip_special_tokens=True)
    out = _greedy(model, turn2, NosaCache(model.config), 8, pad)
    one_prompt = tokenizer.decode(out[0, turn2.shape[1]:], skip_special_tokens=True)
    original_ids = encode(sample.prompt, sample.add_special_tokens)
    out = _greedy(model, original_ids, NosaCache(model.config), 8, pad)
    original = tokenizer.decode(out[0, original_ids.shape[1]:], skip_special_tokens=True)
    return dict(key=sample.answers[0], turn1_tokens=turn1.shape[1], turn2_new_tokens=turn_tokens,
                reused=reused, one_prompt=one_prompt, original=original,
                found_reused=sample.score(reused) == 1.0, found_one_prompt=sample.score(one_prompt) == 1.0,
                found_original=sample.score(original) == 1.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192, help="pass-key prompt tokens (default: 8192)")
    parser.add_argument("--samples", type=int, default=15, help="prompts (default: 15)")
    parser.add_argument("--answer", type=int, default=8, help="tokens answered to turn 1 (default: 8)")
    parser.add_argument("--filler", type=int, default=300, help="noise tokens before turn 2's question (default: 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, tokenizer, name, info = load_smollm2(args.length, None)
    samples = generate_samples("passkey", n=args.samples, length=args.length, tokenizer=tokenizer, seed=args.seed)
    report = dict(environment=environment(), model=name, settings=info, nosa_config=dict(model.config.nosa),
                  args=vars(args), rows=[])
    for i, sample in enumerate(samples):
        start = time.perf_counter()
        row = run_sample(model, tokenizer, sample, args)
        row["seconds"] = time.perf_counter() - start
        report["rows"].append(row)
        rows = report["rows"]
        report["found"] = {k: sum(r[f"found_{k}"] for r in rows) for k in ("reused", "one_prompt", "original")}
        print(f"{i}: key {row['key']} reused {row['reused']!r} one prompt {row['one_prompt']!r} "
              f"original {row['original']!r} ({row['seconds']:.0f} s) found so far {report['found']}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
