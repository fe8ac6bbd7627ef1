"""Which blocks would each QUOKA block score choose for a prompt's last chunk? SmolLM2-135M-Instruct, dense forward.

The first answer token of a pass-key prompt comes from the prompt's last prefill chunk, so that chunk's QUOKA
selection must hold the key's block. This script runs each pass-key prompt once densely, takes every layer's
post-RoPE queries and keys (a forward pre-hook on the attention), and for the last chunk and every (layer, KV head)
asks each scoring rule which blocks it would choose (sink + local + the top blocks, the prefill budget in all):

- how often the chosen blocks hold the key ("needle-block hit");
- the same on retrieval heads only (more than 20% of the prompt's last query's attention on the key's blocks);
- the share of the last query's attention (outside the chunk) that the chosen blocks hold.

The oracle takes the blocks that the last query attends to most. Rules: ``cosine`` (QUOKA's score before issue 16:
L2-normalised queries averaged over the GQA group, max over the kept queries), with the chunk's last 16 queries
added or alone, with a max over the group, with 64 kept queries; ``mass-max`` (per kept query and head a softmax
over windows of q.k~/sqrt(D), summed over the group, max over the kept queries) and ``mass-mean`` (the same, mean
over the kept queries: the library's score now).

    python experiments/quoka_selection.py --length 2048 --samples 6

The queries and keys are the dense forward's, not those of a QUOKA prefill: it ranks the rules, it does not
replace ``quoka_passkey.py``.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

from hf_nosa.eval.runner import nosa_layout
from hf_nosa.eval.tasks import generate_samples
from hf_nosa.modeling.loading import load_causal_lm
from hf_nosa.rules.selection import compress_keys, force_sink_and_local, pool_windows_to_blocks, topk_recent_first

KEPT = 16


def capture(model) -> dict:
    """Every layer's post-RoPE ``(queries [H, T, D], keys [Hk, T, D])`` of the next forward, by layer index."""
    store = {}

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        store[module.layer_idx] = (q[0].detach().float(), k[0].detach().float())

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return store


def rules(q, k, cfg, start: int, K: int) -> dict:
    """Blocks ``[Hk, K]`` chosen for the chunk of queries ``q`` ``[H, T, D]`` starting at ``start``, per rule."""
    H, T, D = q.shape
    Hk = k.shape[0]
    G = H // Hk
    n_blocks = start // cfg.block_size
    windows = compress_keys(k[None, :, :start], cfg)[0]  # [Hk, W, D]
    current = torch.tensor([n_blocks])

    def pick(window_scores):  # [Hk, W] -> [Hk, K]
        blocks = pool_windows_to_blocks(window_scores, n_blocks, cfg, float("-inf"))[None, :, None]
        return topk_recent_first(force_sink_and_local(blocks, current, cfg)[0], K)[0, :, 0]

    def least_similar(n):  # QUOKA's query choice: per head the n queries least similar to the chunk's mean
        cosine = (F.normalize(q, dim=-1) * F.normalize(q.mean(1, keepdim=True), dim=-1)).sum(-1)
        return torch.topk(cosine, min(n, T), dim=-1, largest=False).indices  # [H, n]

    def kept(index):  # [H, n] -> [Hk, G, n, D]
        return torch.stack([q[h, index[h]] for h in range(H)]).view(Hk, G, -1, D)

    def cosine(index, group="mean"):
        qn, kn = F.normalize(kept(index), dim=-1), F.normalize(windows, dim=-1)
        if group == "mean":
            return torch.einsum("gnd,gwd->gnw", qn.mean(1), kn).amax(1)
        return torch.einsum("gjnd,gwd->gjnw", qn, kn).amax(1).amax(1)

    def mass(index, over_queries):
        probs = (torch.einsum("gjnd,gwd->gjnw", kept(index), windows) / math.sqrt(D)).softmax(-1).sum(1)
        return probs.amax(1) if over_queries == "max" else probs.mean(1)

    chosen, last = least_similar(KEPT), torch.arange(T - 16, T).expand(H, 16)
    out = {
        "cosine": pick(cosine(chosen)),
        "cosine + last 16": pick(cosine(torch.cat([chosen, last], 1))),
        "cosine, last 16 only": pick(cosine(last)),
        "cosine, max over group": pick(cosine(chosen, "max")),
        "cosine, 64 kept": pick(cosine(least_similar(64))),
        "mass-max": pick(mass(chosen, "max")),
        "mass-mean (library)": pick(mass(chosen, "mean")),
    }
    logits = torch.einsum("hd,hsd->hs", q[:, -1], k.repeat_interleave(G, 0)[:, : start + T]) / math.sqrt(D)
    attention = logits.softmax(-1)[:, :start].view(Hk, G, n_blocks, cfg.block_size).sum((1, 3)) / G  # [Hk, N]
    out["oracle (last query)"] = topk_recent_first(force_sink_and_local(attention[None, :, None], current, cfg)[0],
                                                   K)[0, :, 0]
    return out, attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--ratios", default="4,8", help="budget = length / ratio, comma-separated")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size (NosaConfig's default)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm("smollm2")
    layers = capture(model)
    samples = generate_samples("passkey", n=args.samples, length=args.length, tokenizer=tokenizer, seed=0)
    budgets = [args.length // int(x) for x in args.ratios.split(",")]
    tally = {b: {"pairs": 0, "retrieval": 0, "hit": defaultdict(float), "retrieval hit": defaultdict(float),
                 "mass": defaultdict(float)} for b in budgets}
    used = 0
    for sample in samples:
        ids = tokenizer(sample.prompt, add_special_tokens=sample.add_special_tokens, return_tensors="pt")["input_ids"]
        key = tokenizer(" " + sample.answers[0], add_special_tokens=False)["input_ids"]
        tokens = ids[0].tolist()
        at = next(i for i in range(len(tokens)) if tokens[i : i + len(key)] == key)
        start = (len(tokens) - 1) // args.chunk * args.chunk
        if at >= start:  # the key is in the last chunk itself: nothing to select
            continue
        used += 1
        key_blocks = {at // 64, (at + len(key)) // 64}
        with torch.no_grad():
            model(ids)
        for budget in budgets:
            cfg, t = nosa_layout(None, budget), tally[budget]
            for q, k in layers.values():
                chosen, attention = rules(q[:, start:], k, cfg, start, cfg.prefill_budget_blocks)
                for h in range(k.shape[0]):
                    t["pairs"] += 1
                    on_key = float(attention[h, sorted(key_blocks)].sum() / attention[h].sum()) > 0.2
                    t["retrieval"] += on_key
                    for name, blocks in chosen.items():
                        picked = {b for b in blocks[h].tolist() if b >= 0}
                        t["hit"][name] += bool(picked & key_blocks)
                        t["retrieval hit"][name] += on_key and bool(picked & key_blocks)
                        t["mass"][name] += float(attention[h, sorted(picked)].sum() / attention[h].sum())
    print(f"{used} of {len(samples)} prompts have the key before the last chunk")
    for budget, t in tally.items():
        cfg = nosa_layout(None, budget)
        print(f"\nlength {args.length}, budget {budget} ({cfg.prefill_budget_blocks} blocks: sink {cfg.sink_blocks}, "
              f"local {cfg.local_blocks}); {t['pairs']} (layer, KV head) pairs, {t['retrieval']} on retrieval heads")
        print(f"{'rule':24} {'key hit':>8} {'on retrieval':>13} {'last-query mass':>16}")
        for name in t["hit"]:
            print(f"{name:24} {t['hit'][name] / max(t['pairs'], 1):8.2f} "
                  f"{t['retrieval hit'][name] / max(t['retrieval'], 1):13.2f} {t['mass'][name] / max(t['pairs'], 1):16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
