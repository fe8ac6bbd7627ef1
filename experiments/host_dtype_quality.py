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

    OMP_NUM_THREADS=1 python experiments/host_dtype_quality.py --models demo,smollm2 --dtypes float32,bfloat16 \\
        --smollm2-docs 6 --demo-docs 8 --passkeys 15 --out docs/results/host-dtype-quality.json

Two models side by side (one core each): run each with its own ``--out``, then ``--merge A.json B.json --out C.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import torch

import hf_nosa
from hf_nosa import NosaCache, to_nosa
from hf_nosa.config import HOST_DTYPES
from hf_nosa.demo import DEFAULT_MODEL, demo_settings
from hf_nosa.eval import evaluate_tasks, generate_samples, load_model, long_generation_perplexity, perplexity_documents
from hf_nosa.eval.runner import _Traffic, environment, nosa_layout

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
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="only join the runs of these result files (run side by side) into --out")
    args = parser.parse_args(argv)
    if args.merge:
        if not args.out:
            raise ValueError("--merge needs --out")
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        merged = {"parts": [{"environment": p["environment"], "settings": p["settings"]} for p in parts],
                  "runs": [run for p in parts for run in p["runs"]]}
        Path(args.out).write_text(json.dumps(merged, indent=2))
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


if __name__ == "__main__":
    raise SystemExit(main())
