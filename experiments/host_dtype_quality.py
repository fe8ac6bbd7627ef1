"""Does a quantized host store (issue 18: ``NosaConfig.host_dtype``) keep the quality of the unquantized one?

Issue 18's quality target: long-generation perplexity of SmolLM2-135M-Instruct and of the shipped demo model within
1% of the bf16 store, and the demo's pass-key accuracy unchanged. For each model and model dtype, every document and
every pass-key prompt runs once per host_dtype ("auto": the model's dtype; "float8_e4m3fn"; "int8"), so the formats
are compared on the same tokens, one document (prompt) at a time.

- ``smollm2``: SmolLM2-135M-Instruct converted untrained (``to_nosa``, A = 0) under the evaluation's layout
  (``eval.runner.nosa_layout``, dense prefill) at budget = context / 8; long-generation perplexity
  (``eval.long_generation_perplexity``: the last ``--ppl-tokens`` tokens of standard-library files fed through decode).
- ``demo``: the shipped demo model (``hf_nosa/assets/demo_model``) with the demo's defaults (its demo.json context and
  budget, its own "nosa" section, dense prefill); the same perplexity at that context, and the demo's task (pass key,
  ``eval.evaluate_tasks`` one prompt at a time, so each prompt's answer is compared across formats).

On the CPU the evaluation runs the model in fp32, where "auto" is an fp32 store; ``--dtypes float32,bfloat16`` also runs
the model in bf16, where "auto" is the bf16 store the issue's target names. Traffic (bytes moved host-to-device per
decoded token, locality) and host bytes per token come from ``NosaCache.stats()``.

    OMP_NUM_THREADS=1 python experiments/host_dtype_quality.py --models demo --dtypes float32,bfloat16 \\
        --demo-docs 16 --passkeys 16 --out demo.json
    OMP_NUM_THREADS=1 python experiments/host_dtype_quality.py --models smollm2 --smollm2-docs 8 --out smollm2.json
    OMP_NUM_THREADS=1 python experiments/host_dtype_quality.py --probe --models demo,smollm2 --demo-docs 4 \\
        --smollm2-docs 1 --out probe.json
    python experiments/host_dtype_quality.py --merge demo.json smollm2.json probe.json --out results.json
    python experiments/host_dtype_quality.py --table results.json

Runs with their own ``--out`` can go side by side (one core each); ``--merge`` joins them and adds the paired
comparisons. CPU, one thread, idle: about 7 s per demo document or prompt and format, 45 s per SmolLM2 document and
format (several times that on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_nosa
from hf_nosa import NosaCache, to_nosa
from hf_nosa.config import HOST_DTYPES
from hf_nosa.cli.demo import DEFAULT_MODEL, demo_settings
from hf_nosa.eval import evaluate_tasks, generate_samples, load_model, long_generation_perplexity, perplexity_documents
from hf_nosa.eval.runner import _Traffic, dense_attention_outside_nosa_cache, environment, nosa_layout
from hf_nosa.cache.host_quant import dequantize_blocks, quantize_blocks

MODELS = ("demo", "smollm2")
DTYPES = ("float32", "bfloat16")


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
        return out.stdout.strip() + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def setup(name: str, dtype: torch.dtype, smollm2_context: int):
    """``(model, tokenizer, NosaConfig, context)``: the model as the evaluation (smollm2) or the demo runs it."""
    if name == "smollm2":
        model, tokenizer = load_model("smollm2", dtype=dtype)
        config = nosa_layout(None, smollm2_context // 8)
        model = to_nosa(model, config)
        return model.to(dtype).eval(), tokenizer, config, smollm2_context
    model, tokenizer = load_model(DEFAULT_MODEL, dtype=dtype)
    info = demo_settings(DEFAULT_MODEL)
    base = hf_nosa.NosaConfig.from_model_config(model.config)
    context = int(info["context_tokens"])
    # the demo's own defaults: its demo.json budget, its "nosa" section, dense prefill (``hf-nosa demo --prefill``)
    config = base.replace(budget_tokens=int(info["budget_tokens"]), prefill="dense")
    return model, tokenizer, config, context


def _host_bytes_per_token(cache) -> int:
    """Host-store bytes one token of one sequence takes over all layers (the format's cost, not the chunks' slack)."""
    return sum(layer.host.token_bytes() for layer in cache.layers if layer.is_initialized)


def perplexity_rows(model, docs, config, host_dtypes, generate_tokens, log, save, out: dict) -> None:
    """Fill ``out`` per host_dtype: each document's NLL sum and token count, traffic and host bytes per token
    (``save()`` after each document, so a stopped run keeps what it measured)."""
    out.update({hd: {"documents": [], "nll_sum": [], "tokens": [], "seconds": []} for hd in host_dtypes})
    traffic = {hd: _Traffic() for hd in host_dtypes}
    for name, ids in docs:
        for hd in host_dtypes:
            row, caches = out[hd], []
            cfg = config.replace(host_dtype=hd)

            def on_batch(cache, result, hd=hd, caches=caches):
                traffic[hd].add(cache, result, result.nll.shape[0])
                caches.append(cache)

            start = time.perf_counter()
            result = long_generation_perplexity(model, [ids], make_cache=lambda cfg=cfg: NosaCache(model.config, cfg),
                                                generate_tokens=generate_tokens, batch_size=1, on_batch=on_batch)
            row["seconds"].append(time.perf_counter() - start)
            row["documents"].append(name)
            row["nll_sum"].append(result["nll"] * result["tokens"])
            row["tokens"].append(result["tokens"])
            row["host_bytes_per_token"] = _host_bytes_per_token(caches[0])
            row["perplexity"] = math.exp(sum(row["nll_sum"]) / sum(row["tokens"]))
            row["per_document_perplexity"] = [math.exp(s / n) for s, n in zip(row["nll_sum"], row["tokens"])]
            row.update(traffic[hd].summary())
            log(f"  ppl {name} {hd}: {row['per_document_perplexity'][-1]:.4f} ({row['seconds'][-1]:.0f}s)")
        save()


def passkey_rows(model, tokenizer, config, context, host_dtypes, n, seed, log) -> dict:
    """Per host_dtype: each pass-key prompt's score (1 or 0) and the traffic of its decode."""
    samples = generate_samples("passkey", n=n, length=context, tokenizer=tokenizer, seed=seed)
    out = {hd: {"scores": [], "locality": [], "bytes_to_device_per_token": []} for hd in host_dtypes}
    for i, sample in enumerate(samples):
        for hd in host_dtypes:
            result = evaluate_tasks(model, tokenizer, tasks=["passkey"], length=context, method="nosa",
                                    nosa_config=config.replace(host_dtype=hd), samples=1, batch_size=1,
                                    prepared=[sample])
            out[hd]["scores"].append(result["tasks"]["passkey"])
            out[hd]["locality"].append(result["locality"])
            out[hd]["bytes_to_device_per_token"].append(result["bytes_to_device_per_token"])
        log(f"  passkey {i}: " + " ".join(f"{hd}={out[hd]['scores'][-1]:.0f}" for hd in host_dtypes))
    for row in out.values():
        row["accuracy"] = sum(row["scores"]) / len(row["scores"])
    return out


# ----- why a format loses: K against V, and finer scales (``--probe``) -----

GRANULARITIES = ("block", "token", "channel")  # one scale per (block, KV head), per token, per channel of a block
PROBE_VARIANTS = tuple(
    (fmt, which, k_grain, v_grain)
    for fmt in ("float8_e4m3fn", "int8")
    for which, k_grain, v_grain in (("K", "block", None), ("V", None, "block"), ("KV", "block", "block"),
                                    ("KV", "token", "token"), ("KV", "channel", "token"))
)


def fake_quantize(x: torch.Tensor, fmt: str, grain: str, block: int) -> torch.Tensor:
    """``x [B, Hk, T, D]`` through the host format and back (``host_quant``), with one scale per (block of
    ``block`` tokens, KV head) (``grain="block"``, the store's), per token, or per channel of a block; the last,
    incomplete block stays exact, as in the store."""
    B, Hk, T, D = x.shape
    n = T // block * block
    full = x[:, :, :n].reshape(B, Hk, n // block, block, D)
    if grain == "token":
        full = full.reshape(B, Hk, n, 1, D)
    elif grain == "channel":
        full = full.transpose(-1, -2).reshape(B, Hk, n // block, D, 1, block)
    q, scale = quantize_blocks(full, fmt)
    out = dequantize_blocks(q, scale, x.dtype)
    if grain == "channel":
        out = out.reshape(B, Hk, n // block, D, block).transpose(-1, -2)
    return torch.cat([out.reshape(B, Hk, n, D), x[:, :, n:]], 2)


class FakeQuantCache(DynamicCache):
    """Full attention over K and/or V rounded through a host format, one whole prompt in one forward; sums the
    squared rounding error and the squared values of K and of V over every layer."""

    def __init__(self, config, fmt, k_grain, v_grain, block):
        super().__init__(config=config)
        self.fmt, self.k_grain, self.v_grain, self.block = fmt, k_grain, v_grain, block
        self.error = {"K": [0.0, 0.0], "V": [0.0, 0.0]}  # [sum of squared error, sum of squares]
        self.exact_values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # the store computes eviction scores from the exact values; a plain cache makes the layer recompute them from
        # what it returns, so the layer's eviction head is handed the exact ones (``exact_eviction_input``)
        self.exact_values[layer_idx] = value_states.transpose(1, 2).flatten(2)
        out = []
        for name, x, grain in (("K", key_states, self.k_grain), ("V", value_states, self.v_grain)):
            if grain is not None:
                y = fake_quantize(x.float(), self.fmt, grain, self.block).to(x.dtype)
                self.error[name][0] += float((y.float() - x.float()).square().sum())
                self.error[name][1] += float(x.float().square().sum())
                x = y
            out.append(x)
        return super().update(out[0], out[1], layer_idx, *args, **kwargs)


def exact_eviction_input(model, cache_ref: list):
    """Forward pre-hooks: each layer's eviction head gets the exact values its FakeQuantCache saw (a NOSA layer
    calls the head on the new values, then on what the cache returned)."""
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if not hasattr(attn, "eviction_head"):
            continue

        def hook(module, args, idx=attn.layer_idx):
            cache = cache_ref[0]
            if cache is not None and idx in cache.exact_values:
                return (cache.exact_values[idx],)
            return None

        hooks.append(attn.eviction_head.register_forward_pre_hook(hook))
    return hooks


@torch.no_grad()
def store_error(model, docs, config) -> dict:
    """Relative RMS error of the K and V a NosaCache's host store gives back after a dense prefill of each document,
    per quantized format, against the "auto" store: the rounding the decode steps fetch, to set beside the probe's
    (each complete block rounded once, the last incomplete block exact)."""
    from hf_nosa.eval import decode

    def stored(hd, ids):
        cache = NosaCache(model.config, config.replace(host_dtype=hd))
        decode(model, torch.tensor([ids]), cache=cache, decode_from=len(ids))
        return [layer.host.read(0, layer.host.length, "cpu")[:2] for layer in cache.layers]

    out = {}
    for hd in HOST_DTYPES[1:]:
        sums = {"K": [0.0, 0.0], "V": [0.0, 0.0]}
        for _, ids in docs:
            for exact, rounded in zip(stored("auto", ids), stored(hd, ids)):
                for name, x, y in (("K", exact[0], rounded[0]), ("V", exact[1], rounded[1])):
                    sums[name][0] += float((y.float() - x.float()).square().sum())
                    sums[name][1] += float(x.float().square().sum())
        out[hd] = {f"{name.lower()}_relative_rms_error": math.sqrt(a / b) for name, (a, b) in sums.items()}
    return out


@torch.no_grad()
def probe_rows(model, docs, block, scored, log) -> list[dict]:
    """Teacher-forced NLL of each document's last ``scored`` tokens with full attention (a plain cache, so every
    block is attended) for exact K/V and each ``PROBE_VARIANTS`` rounding, and the relative RMS error of K and V."""
    cache_ref = [None]
    hooks = exact_eviction_input(model, cache_ref)
    rows = []
    try:
        with dense_attention_outside_nosa_cache(model):
            for variant in ((None, "none", None, None), *PROBE_VARIANTS):
                fmt, which, k_grain, v_grain = variant
                nll, count, err = 0.0, 0, {"K": [0.0, 0.0], "V": [0.0, 0.0]}
                for _, ids in docs:
                    ids_t = torch.tensor([ids])
                    cache = FakeQuantCache(model.config, fmt, k_grain, v_grain, block) if fmt else DynamicCache(
                        config=model.config)
                    cache_ref[0] = cache if fmt else None
                    logits = model(input_ids=ids_t, use_cache=True, past_key_values=cache,
                                   logits_to_keep=scored + 1).logits[0, :-1].float()
                    targets = ids_t[0, -scored:]
                    nll += float(-torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum())
                    count += scored
                    if fmt:
                        for name in err:
                            err[name][0] += cache.error[name][0]
                            err[name][1] += cache.error[name][1]
                row = {"format": fmt or "exact", "quantized": which, "k_scale": k_grain, "v_scale": v_grain,
                       "perplexity": math.exp(nll / count)}
                for name, (sq, total) in err.items():
                    if total:
                        row[f"{name.lower()}_relative_rms_error"] = math.sqrt(sq / total)
                if rows:
                    row["ratio_to_exact"] = row["perplexity"] / rows[0]["perplexity"]
                rows.append(row)
                log(f"  probe {row['format']} {which} K:{k_grain} V:{v_grain}: ppl {row['perplexity']:.4f} "
                    f"(x{row.get('ratio_to_exact', 1.0):.4f}) K err {row.get('k_relative_rms_error', 0):.4f} "
                    f"V err {row.get('v_relative_rms_error', 0):.4f}")
    finally:
        for hook in hooks:
            hook.remove()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,smollm2", help=f"comma-separated, of {MODELS}")
    parser.add_argument("--dtypes", default="float32", help=f"model dtypes, comma-separated, of {DTYPES}")
    parser.add_argument("--host-dtypes", default=",".join(HOST_DTYPES), help="NosaConfig.host_dtype values to compare")
    parser.add_argument("--smollm2-context", type=int, default=4096, help="SmolLM2 document length in tokens")
    parser.add_argument("--smollm2-docs", type=int, default=4, help="SmolLM2 perplexity documents")
    parser.add_argument("--demo-docs", type=int, default=8, help="demo-model perplexity documents")
    parser.add_argument("--passkeys", type=int, default=15, help="demo-model pass-key prompts (0 skips them)")
    parser.add_argument("--ppl-tokens", type=int, default=128, help="tokens scored through decode per document")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file for the results (rewritten after each piece)")
    parser.add_argument("--probe", action="store_true",
                        help="instead: full attention over K and/or V rounded per format and scale granularity")
    parser.add_argument("--table", default=None, metavar="JSON",
                        help="only print the markdown tables of a merged result file")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="only join the runs of these result files (run side by side) into --out")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(json.loads(Path(args.table).read_text())))
        return 0
    if args.merge:
        if not args.out:
            raise ValueError("--merge needs --out")
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        for part in parts:  # the parts' own --out is where they were written, not where the results live
            written = part["settings"]["out"]
            part["settings"]["out"] = Path(written).name
            part["environment"]["command"] = part["environment"]["command"].replace(written, Path(written).name)
        merged = {"parts": [{"environment": p["environment"], "settings": p["settings"]} for p in parts],
                  "runs": [run for p in parts for run in p["runs"]]}
        for run in merged["runs"]:
            compare(run)
        Path(args.out).write_text(json.dumps(merged, indent=2))
        for run in merged["runs"]:
            summarize(run, [hd for hd in HOST_DTYPES if hd in run.get("perplexity", run.get("passkey", {}))], print)
        return 0
    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    host_dtypes = [h for h in args.host_dtypes.split(",") if h]
    for value, allowed, flag in ((models, MODELS, "--models"), (dtypes, DTYPES, "--dtypes"),
                                 (host_dtypes, HOST_DTYPES, "--host-dtypes")):
        for item in value:
            if item not in allowed:
                raise ValueError(f"{flag}: {item!r} is unknown; allowed values are {allowed}")
    torch.set_num_threads(args.threads)
    report = {"environment": {**environment(), "commit": _commit(), "threads": args.threads},
              "settings": vars(args), "runs": []}

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2))

    def log(text):
        print(text, flush=True)

    for name in models:
        for dtype_name in dtypes:
            started = time.perf_counter()
            model, tokenizer, config, context = setup(name, getattr(torch, dtype_name), args.smollm2_context)
            n_docs = args.smollm2_docs if name == "smollm2" else args.demo_docs
            run = {"model": name, "dtype": dtype_name, "context_tokens": context, "nosa_config": config.to_dict(),
                   "ppl_tokens": args.ppl_tokens}
            report["runs"].append(run)
            log(f"{name} {dtype_name}: context {context}, budget {config.budget_tokens}")
            if n_docs and args.probe:
                docs = perplexity_documents(tokenizer, length=context, n=n_docs, seed=args.seed)
                run["store_error"] = store_error(model, docs, config)
                log(f"  store error: {run['store_error']}")
                run["probe"] = probe_rows(model, docs, config.block_size, args.ppl_tokens, log)
                run["probe_documents"] = [name for name, _ in docs]
                run["seconds"] = time.perf_counter() - started
                save()
                continue
            if n_docs:
                docs = perplexity_documents(tokenizer, length=context, n=n_docs, seed=args.seed)
                run["perplexity"] = {}
                perplexity_rows(model, docs, config, host_dtypes, args.ppl_tokens, log, save, run["perplexity"])
            if name == "demo" and args.passkeys:
                run["passkey"] = passkey_rows(model, tokenizer, config, context, host_dtypes, args.passkeys, args.seed,
                                              log)
            run["seconds"] = time.perf_counter() - started
            summarize(run, host_dtypes, log)
            save()
    return 0


def compare(run: dict) -> None:
    """Each format against the "auto" store on the same documents (prompts): the ratio of perplexities over the
    documents both finished, with a 95% interval from the spread of the per-document log ratios, and how many
    pass-key prompts got the same score."""
    ppl = run.get("perplexity") or {}
    if "auto" in ppl:
        base = ppl["auto"]
        for hd, row in ppl.items():
            n = min(len(row["nll_sum"]), len(base["nll_sum"]))
            d = [(row["nll_sum"][i] - base["nll_sum"][i]) / row["tokens"][i] for i in range(n)]
            mean = sum(d) / n
            spread = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else float("nan")
            weighted = sum(row["nll_sum"][i] - base["nll_sum"][i] for i in range(n)) / sum(row["tokens"][:n])
            row["paired"] = {"documents": n, "ratio_to_auto": math.exp(weighted),
                             "ratio_95_interval": [math.exp(mean - 1.96 * spread), math.exp(mean + 1.96 * spread)],
                             "per_document_ratio": [math.exp(x) for x in d]}
    keys = run.get("passkey") or {}
    if "auto" in keys:
        for row in keys.values():
            n = min(len(row["scores"]), len(keys["auto"]["scores"]))
            row["same_as_auto"] = sum(row["scores"][i] == keys["auto"]["scores"][i] for i in range(n))


def summarize(run: dict, host_dtypes, log) -> None:
    """Each format's perplexity against the "auto" store's (``ratio``), and its pass-key accuracy."""
    ppl, keys = run.get("perplexity"), run.get("passkey")
    for hd in host_dtypes:
        line = f"{run['model']} {run['dtype']} {hd}:"
        if ppl:
            row = ppl[hd]
            if "auto" in ppl:
                row["ratio_to_auto"] = row["perplexity"] / ppl["auto"]["perplexity"]
            line += (f" ppl {row['perplexity']:.4f} (x{row.get('ratio_to_auto', float('nan')):.4f}) locality "
                     f"{row.get('locality', float('nan')):.3f} bytes/token {row.get('bytes_to_device_per_token', 0):,.0f}"
                     f" host bytes/token {row['host_bytes_per_token']:,.0f}")
        if keys:
            line += f" passkey {keys[hd]['accuracy']:.3f}"
        log(line)


def tables(report: dict) -> str:
    """The merged results as markdown: perplexity and traffic, pass keys, and the probe."""
    lines = ["| model | model dtype | host_dtype | documents | perplexity | against auto (95% interval) | locality "
             "| bytes to device per token | host bytes per token |", "|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for hd, row in (run.get("perplexity") or {}).items():
            paired = row.get("paired", {})
            n = paired.get("documents", len(row["nll_sum"]))
            ppl = math.exp(sum(row["nll_sum"][:n]) / sum(row["tokens"][:n]))
            against = "-" if hd == "auto" else (f"{100 * (paired['ratio_to_auto'] - 1):+.2f}% "
                                                f"({100 * (paired['ratio_95_interval'][0] - 1):+.2f}% to "
                                                f"{100 * (paired['ratio_95_interval'][1] - 1):+.2f}%)")
            lines.append(f"| {run['model']} | {run['dtype']} | {hd} | {n} | {ppl:.4f} | {against} | "
                         f"{row['locality']:.3f} | {row['bytes_to_device_per_token']:,.0f} | "
                         f"{row['host_bytes_per_token']:,} |")
    lines += ["", "| model dtype | host_dtype | pass keys found | same score as auto |", "|---|---|---|---|"]
    for run in report["runs"]:
        for hd, row in (run.get("passkey") or {}).items():
            lines.append(f"| {run['dtype']} | {hd} | {sum(row['scores']):.0f}/{len(row['scores'])} | "
                         f"{row.get('same_as_auto', '-')}/{len(row['scores'])} |")
    for run in report["runs"]:
        if "probe" not in run:
            continue
        lines += ["", f"{run['model']} ({run['dtype']}, {len(run['probe_documents'])} documents), full attention:",
                  "", "| format | rounded | K scale per | V scale per | K relative RMS error | V relative RMS error "
                  "| perplexity against exact |", "|---|---|---|---|---|---|---|"]
        for row in run["probe"][1:]:
            lines.append(f"| {row['format']} | {row['quantized']} | {row['k_scale'] or '-'} | {row['v_scale'] or '-'} | "
                         f"{100 * row.get('k_relative_rms_error', 0):.2f}% | "
                         f"{100 * row.get('v_relative_rms_error', 0):.2f}% | {100 * (row['ratio_to_exact'] - 1):+.2f}% |")
        for hd, err in run.get("store_error", {}).items():
            lines.append(f"\nThe store after a dense prefill ({hd}): K {100 * err['k_relative_rms_error']:.2f}%, "
                         f"V {100 * err['v_relative_rms_error']:.2f}% relative RMS error.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
