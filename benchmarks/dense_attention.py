"""Dense attention with the eviction bias (``hf_nosa.attention.dense``) against stock sdpa, alone and in a prefill.

Attention alone (bf16, batch 1, 1b and 8b head shapes): plain causal sdpa (what the stock model runs), the
biased attention with a random nonzero bias over the whole prompt (``q_offset`` 0: sdpa's causal kernel) and over
its last 4096 queries (lower-right causal), and the Triton chunk-attention kernel on the whole prompt; each row
names the sdpa kernels the profiler saw, and the biased rows carry their largest difference from the einsum
reference ``attend`` over the last 512 queries. Model prefill (1b shape, random weights, ``logits_to_keep=1``, no
cache): the stock model with sdpa, the converted model (``prefill="dense"``) with random nonzero eviction heads,
and the converted model with ``A == 0`` (plain sdpa path). One QUOKA chunk's attention (2048 queries over 4096
gathered tokens plus the chunk, batch 4): plain sdpa on that shape, the biased attention and the Triton kernel,
with TFLOP/s. Nothing is downloaded.

    python -m benchmarks prefill attention --out docs/results
    python -m benchmarks prefill attention --smoke        # tiny sizes on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.train_step import _sync, _timed  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.rules.attend import AttentionInputs, attend  # noqa: E402
from hf_nosa.attention.dense import bias_columns, biased_attention, biased_attention_joined  # noqa: E402
from hf_nosa.kernels.prefill.flash_biased import flash_biased  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402

HEADS = {"1b": (32, 8, 64), "8b": (32, 8, 128)}
SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=259, max_position_embeddings=4096)
NOSA = dict(block_size=64, budget_tokens=4096, query_tokens=1024, sink_tokens=64, local_tokens=1024,
            compress_kernel=32, compress_stride=16, prefill="dense")
SMOKE_NOSA = dict(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                  compress_kernel=8, compress_stride=4, prefill="dense")


def _kernels(fn, device) -> list[str]:
    """Names of the attention kernels one call runs (profiler events with attention-like names)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    words = ("flash", "cudnn", "efficient", "fmha", "attention_math", "triton")
    names = {e.key for e in prof.key_averages() if any(w in e.key.lower() for w in words)}
    return sorted(names)[:8]


def attention_rows(name: str, seq_len: int, args, device, dtype) -> list[dict]:
    H, Hk, D = HEADS[name] if not args.smoke else (4, 2, 16)
    scale = D**-0.5
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, H, seq_len, D, device=device, generator=g).to(dtype)
    k = torch.randn(1, Hk, seq_len, D, device=device, generator=g).to(dtype)
    v = torch.randn(1, Hk, seq_len, D, device=device, generator=g).to(dtype)
    bias = 3.0 * torch.randn(1, Hk, seq_len, device=device, generator=g)
    tail = min(4096, seq_len // 2)
    whole = AttentionInputs(k, v, bias, None, 0, causal=True)
    last = AttentionInputs(k, v, bias, None, seq_len - tail, causal=True)
    flops = 4 * H * D * seq_len * seq_len / 2  # causal: half the logits
    runs = {
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        "biased_causal": lambda: biased_attention(q, whole, scale),  # the library's route (flash_biased on CUDA)
        # the bias in extra head dimensions through sdpa: the route for masks, gradients and other head dims
        "biased_columns_causal": lambda: F.scaled_dot_product_attention(
            *bias_columns(q, k, v, bias, scale), is_causal=True, scale=scale, enable_gqa=True)[..., :D],
        "biased_last_queries": lambda: biased_attention(q[:, :, -tail:], last, scale),
    }
    if device.type == "cuda":
        from hf_nosa.kernels.prefill.chunk_attention import chunk_attention

        index = torch.arange(seq_len, device=device, dtype=torch.int32).expand(1, Hk, 1, seq_len)
        runs["chunk_attention_kernel"] = lambda: chunk_attention(
            q, k, v, bias, index, [0, seq_len], [0], scale, out=torch.empty_like(q))
        runs["flash_biased_kernel"] = lambda: flash_biased(q, k, v, bias, scale, q_offset=0)
    rows = []
    for run, fn in runs.items():
        row = dict(kind="attention", shape=name, seq_len=seq_len, run=run, heads=[H, Hk, D])

        def measure(row=row, run=run, fn=fn):
            seconds = _timed(fn, device, args.repeats)
            row.update(seconds=seconds, kernels=_kernels(fn, device))
            if run != "biased_last_queries":
                row["tflops"] = flops / seconds / 1e12
            if run.startswith("biased") or run == "flash_biased_kernel":
                check = AttentionInputs(k, v, bias, None, seq_len - 512, causal=True)
                ref = attend(q[:, :, -512:], check, scale).float()
                ours = (flash_biased(q[:, :, -512:], k, v, bias, scale, q_offset=seq_len - 512)
                        if run == "flash_biased_kernel" else biased_attention(q[:, :, -512:], check, scale))
                row["max_abs_diff_vs_attend_last_512"] = float((ours.float() - ref).abs().max())

        rows.append(_recorded(row, measure))
    return rows


def _recorded(row: dict, measure) -> dict:
    """Run ``measure`` (which fills ``row``); an OOM or any other error is recorded in the row, so the other rows
    still run. Prints the row as a JSON line."""
    try:
        measure()
    except torch.OutOfMemoryError:
        row["oom"] = True
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"[:500]
    print(json.dumps(row), flush=True)
    return row


def quoka_chunk_rows(name: str, args, device, dtype) -> list[dict]:
    """One QUOKA prefill chunk's attention: ``chunk`` queries over ``budget`` gathered block tokens then the chunk
    itself (lower-right causal), batch ``--quoka-batch``. Runs: plain sdpa on that shape without a bias (the dense
    kernel's rate, what a converted model cannot beat), the library's biased attention (on CUDA the flash_biased
    kernel; elsewhere sdpa with the bias in extra head dimensions; some slots empty), and the Triton chunk-attention
    kernel it replaced."""
    H, Hk, D = HEADS[name] if not args.smoke else (4, 2, 16)
    chunk, budget = (64, 128) if args.smoke else (args.quoka_chunk, 4096)
    B, S, scale = args.quoka_batch, budget + chunk, D**-0.5
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(B, H, chunk, D, device=device, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, D, device=device, generator=g).to(dtype)
    v = torch.randn(B, Hk, S, D, device=device, generator=g).to(dtype)
    bias = 3.0 * torch.randn(B, Hk, S, device=device, generator=g)
    bias[:, :, : budget // 8] = -1e30  # empty slots of the pool
    inputs = AttentionInputs(k, v, bias, None, budget, causal=True)
    flops = 4 * B * H * D * chunk * (budget + chunk / 2)
    runs = {
        "sdpa_no_bias": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1), scale=scale,
            attn_mask=_lower_right_bias(chunk, S, device, dtype)),
        "biased": lambda: biased_attention(q, inputs, scale),
        # what a QUOKA chunk runs on the CPU (pool_attention): the pool's blocks and the chunk go straight into the widened
        # buffers, the KV heads unrepeated
        "biased_joined": lambda: biased_attention_joined(q, [k[:, :, :budget], k[:, :, budget:]],
                                                         [v[:, :, :budget], v[:, :, budget:]],
                                                         [bias[:, :, :budget], bias[:, :, budget:]], scale),
    }
    if device.type == "cuda":
        from hf_nosa.kernels.prefill.chunk_attention import chunk_attention

        index = torch.arange(S, device=device, dtype=torch.int32).expand(B, Hk, 1, S)
        runs["chunk_attention_kernel"] = lambda: chunk_attention(
            q, k, v, bias, index, [0, chunk], [budget], scale, out=torch.empty_like(q))
        runs["flash_biased_kernel"] = lambda: flash_biased(q, k, v, bias, scale, q_offset=budget)
        # what a QUOKA chunk runs on CUDA now (pool_attention): the kernel reads the blocks in place, then the chunk
        pool = (k[:, :, :budget], v[:, :, :budget], bias[:, :, :budget])
        runs["flash_biased_pool"] = lambda: flash_biased(q, k[:, :, budget:], v[:, :, budget:], bias[:, :, budget:],
                                                         scale, prefix=pool)
        runs.update(_quoka_chunk_candidates(q, k, v, bias, budget, scale))
    rows = []
    n = min(256, chunk)
    ref = attend(q[:, :, -n:], AttentionInputs(k, v, bias, None, S - n, causal=True), scale).float()
    for run, fn in runs.items():
        row = dict(kind="quoka_chunk", shape=name, batch=B, chunk=chunk, budget=budget, run=run, heads=[H, Hk, D])

        def measure(row=row, run=run, fn=fn):
            seconds = _timed(fn, device, args.repeats)
            row.update(seconds=seconds, tflops=flops / seconds / 1e12, kernels=_kernels(fn, device))
            if run != "sdpa_no_bias":
                row["max_abs_diff_vs_attend_last_queries"] = float((fn()[:, :, -n:].float() - ref).abs().max())

        rows.append(_recorded(row, measure))
    return rows


def _quoka_chunk_candidates(q, k, v, bias, budget: int, scale: float) -> dict:
    """Other ways to run one chunk's biased attention on CUDA, measured beside the library's (not used by it):

    - ``biased_flash_gqa``: the same bias columns, FlashAttention called with the KV heads as they are (its kernel
      takes GQA itself), instead of repeating keys and values over the group for sdpa's lower-right mask;
    - ``biased_split_lse``: the pool part without a mask (the GQA group folded into the query rows, which a
      maskless call allows) and the chunk part with sdpa's square causal mask, both on cuDNN, merged by their
      log-sum-exp;
    - ``flex_score_mod``: FlexAttention (compiled) adding the bias in ``score_mod``, lower-right causal in
      ``mask_mod``, at the original head dimension.
    """
    B, H, C, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = H // Hk
    q2, k2, v2 = bias_columns(q, k, v, bias, scale)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention

    def flash_gqa():
        return flash(q2, k2, v2, 0.0, True, False, scale=scale)[0][..., :D]

    def split_lse():
        qp = q2.reshape(B, Hk, G * C, -1)  # a maskless call: every query row sees the same keys
        o1, l1 = cudnn(qp, k2[:, :, :budget], v2[:, :, :budget], None, True, 0.0, False, False, scale=scale)[:2]
        kc = k2[:, :, budget:].repeat_interleave(G, 1)
        vc = v2[:, :, budget:].repeat_interleave(G, 1)
        o2, l2 = cudnn(q2, kc, vc, None, True, 0.0, True, False, scale=scale)[:2]
        o1, l1 = o1.reshape(B, H, C, -1).float(), l1.reshape(B, H, C, 1).float()
        o2, l2 = o2.float(), l2.reshape(B, H, C, 1).float()
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
        return ((o1 * w1 + o2 * w2) / (w1 + w2))[..., :D].to(q.dtype)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    offset = S - C

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h // G, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    block_mask = create_block_mask(mask_mod, None, None, C, S, device=q.device)

    def flex():
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)

    return {"biased_flash_gqa": flash_gqa, "biased_split_lse": split_lse, "flex_score_mod": flex}


def _lower_right_bias(Tq: int, S: int, device, dtype):
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(Tq, S)
    allowed = torch.arange(S, device=device)[None, :] <= torch.arange(S - Tq, S, device=device)[:, None]
    return torch.where(allowed, 0.0, float("-inf")).to(dtype)


def prefill_rows(seq_len: int, args, device, dtype) -> list[dict]:
    shape = SHAPE_SMOKE if args.smoke else SHAPE_1B
    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(3, shape["vocab_size"], (args.batch, seq_len), device=device)
    rows = []
    for mode in ("stock", "nosa_zero_heads", "nosa"):
        if mode == "nosa_zero_heads":
            to_nosa(model, NosaConfig(**(SMOKE_NOSA if args.smoke else NOSA)))
        if mode == "nosa":
            randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(1))
        row = dict(kind="prefill", seq_len=seq_len, batch=args.batch, mode=mode)

        def measure(row=row):
            with torch.no_grad():
                row["seconds"] = _timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device,
                                        args.repeats)

        rows.append(_recorded(row, measure))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for dense_attention.json (rewritten after every length)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 8192,32768,65536)")
    parser.add_argument("--batch", type=int, default=1, help="batch of the model prefill")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after one untimed call")
    parser.add_argument("--quoka-batch", type=int, default=4, help="batch of the QUOKA chunk rows")
    parser.add_argument("--quoka-chunk", type=int, default=2048, help="queries of the QUOKA chunk rows (budget 4096)")
    parser.add_argument("--quoka-only", action="store_true", help="only the QUOKA chunk rows (no model prefill)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        dtype, lengths = torch.float32, [int(x) for x in (args.lengths or "256,512").split(",")]
    else:
        if device.type != "cuda":
            parser.error("the full benchmark needs a GPU; use --smoke on the CPU")
        dtype, lengths = torch.bfloat16, [int(x) for x in (args.lengths or "8192,32768,65536").split(",")]
    report = dict(environment(), results=[], targets={})
    for name in HEADS:
        report["results"] += quoka_chunk_rows(name, args, device, dtype)
    if args.quoka_only:
        lengths = []
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"quoka_attention_{args.quoka_chunk}.json"), "w") as f:
                json.dump(report, f, indent=1)
    for seq_len in lengths:
        for name in HEADS:
            report["results"] += attention_rows(name, seq_len, args, device, dtype)
        report["results"] += prefill_rows(seq_len, args, device, dtype)
        prefill = {r["mode"]: r for r in report["results"]
                   if r["kind"] == "prefill" and r["seq_len"] == seq_len and "seconds" in r}
        if "stock" in prefill:
            report["targets"][str(seq_len)] = {
                f"prefill_time_{mode}_over_stock": prefill[mode]["seconds"] / prefill["stock"]["seconds"]
                for mode in ("nosa", "nosa_zero_heads") if mode in prefill
            }
        report["targets"]["goal"] = "prefill_time_nosa_over_stock <= 1.15 at 32768"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "dense_attention_smoke.json" if args.smoke else "dense_attention.json")
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    print(json.dumps(report["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
