"""One retrofit step of a 1B- (or 8B-) shaped Llama: NOSA training attention against dense sdpa.

A step is what ``hf-nosa retrofit`` runs: forward + backward + AdamW on LoRA (llama-3.2-1b recipe) and the
eviction heads, bf16 autocast, gradient checkpointing, batch 1, the allocator with expandable segments (unless
``PYTORCH_ALLOC_CONF`` is set; recorded as ``allocator``). "dense" is the stock model with the same LoRA
and sdpa attention; "nosa" is the converted model training with ``hf_nosa.attention.training`` (random nonzero eviction
heads, so the selection is not trivial). Also times the attention of one layer alone (forward + backward): with
``--backends sparse`` the split path (the default) and the union path beside it, with the split path's work per part
(``split_work``); with flex, each FlexAttention layout (``fold`` 1, the default: one query head per row tile; the
folded layout puts a GQA group's heads in the rows, and also runs with key tiles of one NOSA block). Then its parts
(the selection through the torch rule and through the kernels of ``kernels/train_select.py``, flex's block table),
and the tile coverage per length: the share of the tiles causal attention computes that a union of each tile's
selections visits, for 128x128 tiles and, as a what-if, 64-key tiles. Weights are random: nothing is downloaded.
Every length and shape runs in one command; a run that does not fit the device is recorded as ``oom`` with the
allocator's message, one that fails as ``error``.

    python -m benchmarks train --out docs/results            # 1b at 16K, 32K, 64K
    python -m benchmarks train --shapes 1b,8b --out docs/results
    python -m benchmarks train --smoke        # tiny sizes, CPU, explicit-mask backend
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.training.allocator import allocator_setting, use_expandable_segments  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402
from hf_nosa.attention import training  # noqa: E402
from hf_nosa.kernels.train.sparse_train_plan import split_plan, split_work  # noqa: E402
from hf_nosa.training.retrofit import load_recipe, lora_config  # noqa: E402
from hf_nosa.attention.training import (  # noqa: E402
    FLEX_TILE,
    flex_block_mask,
    flex_fold,
    nosa_training_attention,
    selected_blocks,
)

sparse_module = importlib.import_module("hf_nosa.kernels.train.sparse_train_attention")  # its SPLIT switch

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072)
SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072)
SHAPES = {"1b": (SHAPE_1B, "llama-3.2-1b"), "8b": (SHAPE_8B, "llama-3.1-8b")}
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


def model_step(mode, seq_len, args, shape, cfg, recipe, device, dtype, backend=None) -> dict:
    """Mean time and peak memory of full retrofit steps (after warm-up steps that compile FlexAttention or tune the
    sparse kernels); ``backend``: the NOSA training backend on CUDA (``training.CUDA_BACKEND``)."""
    _reset_peak(device)
    if backend is not None:
        training.CUDA_BACKEND = backend
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
    if mode == "nosa" and device.type == "cuda":
        result["backend"] = training.CUDA_BACKEND
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
    # contiguous: a transposed last dimension sends sdpa to its math kernel
    return (smooth + 0.3 * torch.randn(1, heads, seq_len, dim, device=device, generator=g)).to(dtype).contiguous()


def tile_coverage(bitmap: torch.Tensor, cfg: NosaConfig, *, tile: int, kv_tile: int, fold: int) -> dict:
    """Tiles of ``tile`` query rows x ``kv_tile`` keys the rule visits (a token of the row tile selected a block in
    the key tile, or it is the tile of a token's own block), against the tiles causal attention visits, per KV
    head's selection; with ``fold`` rows per token a row tile spans ``tile / fold`` tokens."""
    B, Hk, T, N = bitmap.shape
    P = cfg.block_size
    per = kv_tile // P
    q_tokens = tile // fold
    n_qt, n_kt = math.ceil(T / q_tokens), math.ceil(N / per)
    tiles = F.pad(bitmap, (0, n_kt * per - N, 0, n_qt * q_tokens - T)).view(B, Hk, n_qt, q_tokens, n_kt, per)
    starts = torch.arange(n_qt, device=bitmap.device) * q_tokens
    last = (torch.clamp(starts + q_tokens, max=T) - 1) // kv_tile
    first = starts // kv_tile
    kt = torch.arange(n_kt, device=bitmap.device)
    own = (kt >= first[:, None]) & (kt <= last[:, None])
    visited = int((tiles.any(5).any(3) | own).sum())
    causal = int((kt <= last[:, None]).sum()) * B * Hk
    return dict(tile=tile, kv_tile=kv_tile, fold=fold, visited=visited, causal=causal, ratio=visited / causal)


def attention_only(seq_len, args, shape, cfg, device, dtype) -> list[dict]:
    """One layer's attention, forward + backward: NOSA (selection + block table + kernel) with each backend of
    ``--backends`` (flex in each layout) against causal sdpa; the parts alone; tile coverage."""
    H, Hk, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    scale = D**-0.5
    backends = args.backends.split(",") if device.type == "cuda" else ["explicit"]
    backend = "flex" if "flex" in backends else backends[0]
    folds = sorted({1, flex_fold(H, Hk, limit=8)}) if backend == "flex" else [None]
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for kind in ("iid", "smooth"):
        g = torch.Generator(device=device).manual_seed(0)
        q = _inputs(kind, H, seq_len, D, device, dtype, g).requires_grad_()
        k = _inputs(kind, Hk, seq_len, D, device, dtype, g).requires_grad_()
        v = torch.randn(1, Hk, seq_len, D, device=device, generator=g).to(dtype).requires_grad_()
        bias = (0.1 * torch.randn(1, Hk, seq_len, device=device, generator=g)).requires_grad_()
        grad = torch.randn(1, H, seq_len, D, device=device, generator=g).to(dtype)
        base = dict(kind="attention", inputs=kind, seq_len=seq_len)

        def dense():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).backward(grad)

        runs = [(dict(mode="dense"), dense)]
        kv_tiles = [None] if backend != "flex" or cfg.block_size >= FLEX_TILE else [None, cfg.block_size]
        if "sparse" in backends:
            # the split path (the default) and the union of each tile's selections in one pass, beside it
            for split in (True, False):
                def sparse(split=split):
                    sparse_module.SPLIT = split
                    try:
                        nosa_training_attention(q, k, v, bias, cfg, scale, backend="sparse").backward(grad)
                    finally:
                        sparse_module.SPLIT = True

                runs.append((dict(mode="nosa", backend="sparse", path="split" if split else "union"), sparse))
        for fold in folds if backend == "flex" or device.type != "cuda" else []:
            for kv_tile in kv_tiles if fold == folds[-1] else [None]:
                def nosa(fold=fold, kv_tile=kv_tile):
                    training.FLEX_KV_TILE = kv_tile  # a key tile of one NOSA block: runs if the kernel divides it
                    try:
                        out = nosa_training_attention(q, k, v, bias, cfg, scale, backend=backend, fold=fold)
                        out.backward(grad)
                    finally:
                        training.FLEX_KV_TILE = None

                runs.append((dict(mode="nosa", backend=backend, fold=fold,
                                  kv_tile=kv_tile or max(FLEX_TILE, cfg.block_size)), nosa))
        for extra, fn in runs:
            _reset_peak(device)
            row = dict(base, **extra)
            try:
                row.update(fwd_bwd_s=_timed(fn, device, args.repeats), peak_memory_gb=_peak_gb(device))
            except torch.OutOfMemoryError:
                row.update(oom=True)
            except Exception as error:  # a layout the kernel cannot compile is a result too
                row.update(error=f"{type(error).__name__}: {error}"[:500])
            q.grad = k.grad = v.grad = bias.grad = None
            add(row)
        with torch.no_grad():
            b = bias.detach()
            bitmap = selected_blocks(q, k, b, cfg, scale)
            # Once per layer and step (the checkpointed recompute finds it). With SELECTION_KERNEL the query-aware
            # selection runs through the kernels of kernels/train_select.py: timed too, with the tokens whose selection
            # differs.
            for kernel in [False, True] if device.type == "cuda" else [False]:
                row = dict(kind="attention_part", inputs=kind, part="selection", seq_len=seq_len,
                           selection_kernel=kernel, calls_per_layer_step=1)
                training.SELECTION_KERNEL = kernel
                try:
                    row["seconds"] = _timed(lambda: selected_blocks(q, k, b, cfg, scale), device, args.repeats)
                    row["tokens_selecting_differently"] = int(
                        (selected_blocks(q, k, b, cfg, scale) != bitmap).any(-1).sum())
                except Exception as error:  # recorded: the rest of the run goes on
                    row["error"] = f"{type(error).__name__}: {error}"[:500]
                finally:
                    training.SELECTION_KERNEL = None  # the default: the kernel on CUDA
                add(row)
            for fold in folds if backend == "flex" else []:
                if fold is not None:
                    add(dict(kind="attention_part", inputs=kind, part="block_table", fold=fold, seq_len=seq_len,
                             seconds=_timed(lambda: flex_block_mask(bitmap, cfg, heads=H, tile=FLEX_TILE, fold=fold),
                                            device, args.repeats)))
            if "sparse" in backends and device.type == "cuda":  # the split path's work, per part
                work = split_work(split_plan(bitmap, heads=H, block_size=cfg.block_size), heads=H,
                                  block_size=cfg.block_size, queries=seq_len)
                add(dict(kind="split_work", inputs=kind, seq_len=seq_len, **work))
            per_query = float(bitmap.sum(-1).float().mean())
            for fold in sorted({1, flex_fold(H, Hk, limit=8)}):
                for kv_tile in sorted({max(FLEX_TILE, cfg.block_size), cfg.block_size}, reverse=True):
                    add(dict(kind="tiles", inputs=kind, seq_len=seq_len, selected_blocks_per_query=per_query,
                             what_if=kv_tile != max(FLEX_TILE, cfg.block_size),
                             **tile_coverage(bitmap, cfg, tile=FLEX_TILE, kv_tile=kv_tile, fold=fold)))
        del q, k, v, bias, grad
    return rows


def _targets(results: list[dict], shape: str, lengths: list[int]) -> dict:
    """Per length: NOSA step time over dense, attention-only time over dense per layout, peak memory ratio."""
    measured = {}
    for seq_len in lengths:
        mine = [r for r in results if r["shape"] == shape and r["seq_len"] == seq_len]
        steps = [r for r in mine if r["kind"] == "model_step" and "step_s" in r]
        dense_steps = [r for r in steps if r["mode"] == "dense"]
        row = {}
        for nosa in (r for r in steps if r["mode"] == "nosa") if dense_steps else ():
            tag = f" ({nosa['backend']})" if "backend" in nosa else ""
            row["step_time_nosa_over_dense" + tag] = nosa["step_s"] / dense_steps[0]["step_s"]
            if dense_steps[0]["peak_memory_gb"]:
                row["peak_memory_nosa_over_dense" + tag] = nosa["peak_memory_gb"] / dense_steps[0]["peak_memory_gb"]
        attn = [r for r in mine if r["kind"] == "attention" and "fwd_bwd_s" in r]
        dense = {r["inputs"]: r["fwd_bwd_s"] for r in attn if r["mode"] == "dense"}
        row["attention_time_nosa_over_dense"] = {
            (f"{r['inputs']}, sparse {r.get('path', 'union')}" if r.get("backend") == "sparse" else
             f"{r['inputs']}, fold {r['fold']}, key tile {r['kv_tile']}"): r["fwd_bwd_s"] / dense[r["inputs"]]
            for r in attn if r["mode"] == "nosa" and r["inputs"] in dense
        }
        measured[str(seq_len)] = row
    return measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for train_step.json (rewritten after every length)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--shapes", default="1b", help="comma-separated model shapes among 1b, 8b (default 1b)")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 16384,32768,65536)")
    parser.add_argument("--steps", type=int, default=2, help="timed model steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed model steps (FlexAttention compiles here)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of the attention-only runs")
    parser.add_argument("--attention-only", action="store_true", help="skip the whole-model steps")
    parser.add_argument("--steps-only", action="store_true", help="skip the one-layer attention runs")
    parser.add_argument("--tile-rows", type=int, default=None,
                        help="query rows per shared tile of the sparse backend (default: TILE_ROWS, 128)")
    parser.add_argument("--backends", default="flex,sparse",
                        help="NOSA training backends timed on CUDA, model steps and attention (flex, sparse)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = args.shapes.split(",")
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown:
        parser.error(f"--shapes {','.join(unknown)} is not supported; allowed values are {', '.join(SHAPES)}")
    if args.smoke:
        dtype, default_lengths = torch.float32, "256,512"
        torch.set_num_threads(1)
    else:
        if device.type != "cuda":
            parser.error("the full benchmark needs a GPU; use --smoke on the CPU")
        dtype, default_lengths = torch.bfloat16, "16384,32768,65536"
    lengths = [int(x) for x in (args.lengths or default_lengths).split(",")]
    backends = args.backends.split(",")
    if not backends or any(b not in ("flex", "sparse") for b in backends):
        parser.error(f"--backends {args.backends!r} is not supported; allowed values are flex, sparse")
    if args.tile_rows is not None:
        if args.tile_rows < 16 or args.tile_rows & (args.tile_rows - 1):
            parser.error(f"--tile-rows {args.tile_rows} is invalid: it must be a power of two >= 16")
        sparse_module.TILE_ROWS = args.tile_rows  # what sparse_train_attention takes when no tile is given
    use_expandable_segments(device)  # the allocator ``retrofit`` runs with, for both modes
    report = dict(environment(), flex_tile=FLEX_TILE, tile_rows=sparse_module.TILE_ROWS, shapes={}, results=[],
                  targets={}, allocator=allocator_setting())
    for name in shapes:
        shape, recipe_name = SHAPES[name]
        recipe = load_recipe(recipe_name)
        cfg = NosaConfig.from_dict(recipe["nosa"])
        if args.smoke:
            name, shape, cfg = "smoke", SHAPE_SMOKE, NosaConfig(**SMOKE_NOSA)
        report["shapes"][name] = dict(shape=shape, recipe=recipe_name, nosa_config=cfg.to_dict(), lora=recipe["lora"])
        for seq_len in lengths:
            rows = []
            if not args.attention_only:
                runs = [("dense", None)] + [("nosa", b) for b in (backends if device.type == "cuda" else [None])]
                for mode, backend in runs:
                    try:
                        row = model_step(mode, seq_len, args, shape, cfg, recipe, device, dtype, backend)
                    except torch.OutOfMemoryError as error:  # the allocator's line says reserved against allocated
                        row = dict(kind="model_step", mode=mode, seq_len=seq_len, oom=True, backend=backend,
                                   message=str(error).split("\n")[0][:400])
                        _reset_peak(device)
                    except Exception as error:  # recorded, so that the other lengths and shapes still run
                        row = dict(kind="model_step", mode=mode, seq_len=seq_len, backend=backend,
                                   error=f"{type(error).__name__}: {error}"[:500])
                        _reset_peak(device)
                    rows.append(row)
                    print(json.dumps(dict({k: v for k, v in row.items() if k != "step_times_s"}, shape=name)),
                          flush=True)
            try:
                if not args.steps_only:
                    rows += attention_only(seq_len, args, shape, cfg, device, dtype)
            except torch.OutOfMemoryError:
                rows.append(dict(kind="attention", seq_len=seq_len, oom=True))
                _reset_peak(device)
            report["results"] += [dict(row, shape=name) for row in rows]
            report["targets"][name] = dict(
                goal="step time nosa / dense <= 1.0 at 32K and <= 0.7 at 64K; peak memory ratio <= 1.0",
                measured=_targets(report["results"], name, lengths),
            )
            if args.out:  # after every length, so that a run cut short keeps what it measured
                os.makedirs(args.out, exist_ok=True)
                name_json = "train_step_smoke.json" if args.smoke else "train_step.json"
                with open(os.path.join(args.out, name_json), "w") as f:
                    json.dump(report, f, indent=1)
    print(json.dumps(report["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
