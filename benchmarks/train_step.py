"""One retrofit step of a 1B-shaped Llama: NOSA training attention (FlexAttention) against dense sdpa training.

A step is what ``hf-nosa retrofit`` runs: forward + backward + AdamW on LoRA (llama-3.2-1b recipe) and the
eviction heads, bf16 autocast, gradient checkpointing, batch 1. "dense" is the stock model with the same LoRA
and sdpa attention; "nosa" is the converted model training with ``hf_nosa.training`` (random nonzero eviction
heads, so the selection is not trivial). Also times the attention of one layer alone (forward + backward) and
its parts (selection, block table), and reports how many FlexAttention tiles the selection visits against
causal attention. Weights are random: nothing is downloaded.

    PYTHONPATH=. python benchmarks/train_step.py --out benchmarks/results
    python benchmarks/train_step.py --smoke        # tiny sizes, CPU, explicit-mask backend
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402
from hf_nosa.retrofit import load_recipe, lora_config  # noqa: E402
from hf_nosa.training import FLEX_TILE, flex_block_mask, nosa_training_attention, selected_blocks  # noqa: E402

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=259, max_position_embeddings=4096)
SMOKE_NOSA = dict(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                  compress_kernel=8, compress_stride=4)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def build(mode: str, shape: dict, cfg: NosaConfig, recipe: dict, device, dtype):
    """The PEFT model and optimizer of one retrofit step, as ``retrofit`` builds them."""
    from peft import get_peft_model

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if mode == "nosa":
        to_nosa(model, cfg)
        randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(1))
        for layer in model.model.layers:
            layer.self_attn.eviction_head.float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    recipe = dict(recipe, lora=dict(recipe["lora"]))
    model = get_peft_model(model, lora_config(recipe))
    eviction = [p for n, p in model.named_parameters() if p.requires_grad and ".eviction_head." in n]
    lora = [p for n, p in model.named_parameters() if p.requires_grad and ".eviction_head." not in n]
    groups = [{"params": lora, "lr": recipe["lr_lora"]}]
    if eviction:
        groups.append({"params": eviction, "lr": recipe["lr_eviction"]})
    return model.train(), torch.optim.AdamW(groups)


def model_step(mode, seq_len, args, shape, cfg, recipe, device, dtype) -> dict:
    """Mean time and peak memory of full retrofit steps (after warm-up steps that compile FlexAttention)."""
    _reset_peak(device)
    model, optimizer = build(mode, shape, cfg, recipe, device, dtype)
    ids = torch.randint(3, shape["vocab_size"], (1, seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> float:
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    began = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - began
    _reset_peak(device)
    times, loss = [], None
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    result = dict(kind="model_step", mode=mode, seq_len=seq_len, step_s=step_s, tokens_per_s=seq_len / step_s,
                  peak_memory_gb=_peak_gb(device), loss=loss, warmup_s=warmup_s, step_times_s=times)
    del model, optimizer
    _reset_peak(device)
    return result


def _timed(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def _inputs(kind: str, heads: int, seq_len: int, dim: int, device, dtype, g) -> torch.Tensor:
    """``[1, heads, T, D]``: "iid" draws every token independently (a random-weight model's queries, the worst case
    for the union of per-token selections in a tile); "smooth" interpolates anchors 64 tokens apart plus noise, so
    that neighbouring tokens ask for similar blocks as in trained models."""
    if kind == "iid":
        return torch.randn(1, heads, seq_len, dim, device=device, generator=g).to(dtype)
    anchors = torch.randn(heads, dim, seq_len // 64 + 1, device=device, generator=g)
    smooth = F.interpolate(anchors, size=seq_len, mode="linear", align_corners=True).transpose(1, 2)[None]
    return (smooth + 0.3 * torch.randn(1, heads, seq_len, dim, device=device, generator=g)).to(dtype)


def attention_only(seq_len, args, shape, cfg, device, dtype) -> list[dict]:
    """One layer's attention, forward + backward: NOSA (selection + block table + kernel) against causal sdpa."""
    H, Hk, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    scale = D**-0.5
    backend = "flex" if device.type == "cuda" else "explicit"
    rows = []
    for kind in ("iid", "smooth"):
        g = torch.Generator(device=device).manual_seed(0)
        q = _inputs(kind, H, seq_len, D, device, dtype, g).requires_grad_()
        k = _inputs(kind, Hk, seq_len, D, device, dtype, g).requires_grad_()
        v = torch.randn(1, Hk, seq_len, D, device=device, generator=g).to(dtype).requires_grad_()
        bias = (0.1 * torch.randn(1, Hk, seq_len, device=device, generator=g)).requires_grad_()
        grad = torch.randn(1, H, seq_len, D, device=device, generator=g).to(dtype)

        def nosa():
            nosa_training_attention(q, k, v, bias, cfg, scale, backend=backend).backward(grad)

        def dense():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).backward(grad)

        for name, fn in (("nosa", nosa), ("dense", dense)):
            _reset_peak(device)
            seconds = _timed(fn, device, args.repeats)
            rows.append(dict(kind="attention", inputs=kind, mode=name, seq_len=seq_len, fwd_bwd_s=seconds,
                             peak_memory_gb=_peak_gb(device)))
        with torch.no_grad():
            b = bias.detach()
            bitmap = selected_blocks(q, k, b, cfg, scale)
            rows.append(dict(kind="attention_part", inputs=kind, part="selection", seq_len=seq_len,
                             seconds=_timed(lambda: selected_blocks(q, k, b, cfg, scale), device, args.repeats)))
            rows.append(dict(kind="attention_part", inputs=kind, part="block_table", seq_len=seq_len,
                             seconds=_timed(lambda: flex_block_mask(bitmap, cfg, heads=H), device, args.repeats)))
            mask = flex_block_mask(bitmap, cfg, heads=H, tile=FLEX_TILE)
            visited = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
            n_q, kv_tile = mask.kv_num_blocks.shape[-1], max(FLEX_TILE, cfg.block_size)
            causal = sum(-(-min(seq_len, (i + 1) * FLEX_TILE) // kv_tile) for i in range(n_q)) * H
            rows.append(dict(kind="tiles", inputs=kind, seq_len=seq_len, visited=visited, causal=causal,
                             ratio=visited / causal, full=int(mask.full_kv_num_blocks.sum()),
                             selected_blocks_per_query=float(bitmap.sum(-1).float().mean())))
        del q, k, v, bias, grad
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for train_step.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 8192,16384)")
    parser.add_argument("--steps", type=int, default=3, help="timed model steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed model steps (FlexAttention compiles here)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of the attention-only runs")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    recipe = load_recipe("llama-3.2-1b")
    if args.smoke:
        shape, cfg, dtype = SHAPE_SMOKE, NosaConfig(**SMOKE_NOSA), torch.float32
        lengths = [int(x) for x in (args.lengths or "256,512").split(",")]
        torch.set_num_threads(1)
    else:
        if device.type != "cuda":
            parser.error("the full benchmark needs a GPU; use --smoke on the CPU")
        shape, cfg, dtype = SHAPE_1B, NosaConfig.from_dict(recipe["nosa"]), torch.bfloat16
        lengths = [int(x) for x in (args.lengths or "8192,16384").split(",")]
    report = dict(environment(), shape=shape, nosa_config=cfg.to_dict(), lora=recipe["lora"],
                  flex_tile=FLEX_TILE, results=[])
    for seq_len in lengths:
        for mode in ("dense", "nosa"):
            try:
                row = model_step(mode, seq_len, args, shape, cfg, recipe, device, dtype)
            except torch.OutOfMemoryError:
                row = dict(kind="model_step", mode=mode, seq_len=seq_len, oom=True)
                _reset_peak(device)
            report["results"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_times_s"}), flush=True)
        for row in attention_only(seq_len, args, shape, cfg, device, dtype):
            report["results"].append(row)
            print(json.dumps(row), flush=True)
    targets = {}
    for seq_len in lengths:
        steps = {r["mode"]: r for r in report["results"] if r["kind"] == "model_step" and r["seq_len"] == seq_len}
        attn = {(r["inputs"], r["mode"]): r for r in report["results"]
                if r["kind"] == "attention" and r["seq_len"] == seq_len}
        if all("step_s" in steps.get(m, {}) for m in ("dense", "nosa")):
            targets[str(seq_len)] = dict(
                step_speed_nosa_over_dense=steps["nosa"]["tokens_per_s"] / steps["dense"]["tokens_per_s"],
                attention_speed_nosa_over_dense={
                    kind: attn[(kind, "dense")]["fwd_bwd_s"] / attn[(kind, "nosa")]["fwd_bwd_s"]
                    for kind in ("iid", "smooth")
                },
                peak_memory_nosa_over_dense=(steps["nosa"]["peak_memory_gb"] / steps["dense"]["peak_memory_gb"]
                                             if steps["dense"]["peak_memory_gb"] else None),
            )
    report["targets"] = dict(goal="at 16K: step speed ratio >= 1, peak memory ratio <= 1.2", measured=targets)
    print(json.dumps(report["targets"], indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "train_step_smoke.json" if args.smoke else "train_step.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
