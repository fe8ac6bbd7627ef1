"""Issue 16's query-share curve: SmolLM2's long-generation perplexity, locality and bytes moved per decoded token as
the budget's query-aware share Q grows and the eviction head's share shrinks, untrained and retrofitted.

At one length and budget = length / ratio, every NOSA cell keeps one sink block and a fixed local window and gives
Q tokens to the query-aware selection and the rest of the budget to the eviction head (``nosa_layout`` with all three
shares given). A cell is ``MODEL:Q`` or ``MODEL:full`` (full attention: transformers' own cache). MODEL is ``base``
(SmolLM2-135M-Instruct, converted by ``evaluate`` with ``to_nosa``, A = 0: "NOSA untrained") or ``retrofit`` (the
adapter shipped in ``hf_nosa/assets/smollm2_adapter`` merged with ``merge_adapter``; trained with Q = 256 at 8K).
Each cell is one ``hf_nosa.eval.evaluate`` call with no suite tasks, so only its perplexity run is measured: the
same documents for every cell (``perplexity_documents``, seed 0), the last ``--ppl-tokens`` of each decoded one
token at a time. Locality and bytes per token are the ``NosaCache.stats()`` of those decode steps.

Cells run in the order given and each is saved as it ends, so two processes may share one ``--results`` file (each
re-reads it before writing) and a later call skips the cells already there. Before each cell, the slowest one so far
says whether it can end before ``--deadline``; one that cannot is listed as skipped.

``--table`` prints a results file (or several joined as ``{"lengths": [...]}``) as the tables of ``docs/results.md``.

Example (CPU, a quick check):
    OMP_NUM_THREADS=1 python experiments/smollm2/query_share.py --length 1024 --queries 0,64 \
        --cells base:full,base:0,base:64 --ppl-docs 1 --ppl-tokens 8 --results qs.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, however this is loaded
from results_file import ResultsFile  # noqa: E402

MODELS = ("base", "retrofit")
SETTINGS = ("model", "length", "budget_ratio", "sink_tokens", "local_tokens", "ppl_docs", "ppl_tokens", "seed", "dtype")


def default_queries(budget: int, block: int) -> list[int]:
    """Q from 0 to half the budget in eighths of it (whole blocks): at 8K, budget 1024: 0, 128, 256, 384, 512."""
    step = max(block, budget // 8 // block * block)
    return list(range(0, budget // 2 + 1, step))


def parse_cells(text: str, queries: list[int]) -> list[tuple[str, int | None]]:
    """``"base:full,retrofit:256"`` -> ``[("base", None), ("retrofit", 256)]``; Q must be one of ``queries``."""
    cells = []
    for item in filter(None, text.split(",")):
        model, _, share = item.partition(":")
        q = None if share == "full" else int(share) if share.isdigit() else -1
        if model not in MODELS or (q is not None and q not in queries):
            raise ValueError(f"--cells: {item!r} is not MODEL:full or MODEL:Q with MODEL in {MODELS} and Q in {queries}")
        cells.append((model, q))
    if not cells:
        raise ValueError("--cells is empty")
    return cells


def cell_name(model: str, q: int | None) -> str:
    return f"{model}:{'full' if q is None else q}"


def summarise(row: dict, q: int | None, model: str, seconds: float) -> dict:
    """The numbers of one cell: perplexity, and for NOSA cells the layout, locality and traffic of its decode."""
    traffic = row.get("perplexity_traffic") or {}
    out = {"cell": cell_name(model, q), "model": model, "query_tokens": q, "perplexity": row["perplexity"],
           "seconds": seconds, "documents": row["perplexity_documents"]}
    if q is not None:
        cfg = row["nosa_config"]
        out["layout"] = {k: cfg[k] for k in ("budget_tokens", "sink_tokens", "local_tokens", "query_tokens")}
        out["layout"]["eviction_tokens"] = cfg["budget_tokens"] - cfg["sink_tokens"] - cfg["local_tokens"] - q
        out.update({k: traffic[k] for k in ("locality", "bytes_to_device_per_token", "device_kv_bytes_per_sequence",
                                            "full_kv_bytes_per_sequence") if k in traffic})
    else:
        out["kv_bytes_read_per_token"] = row.get("kv_bytes_read_per_token")
    return out


def table(data: dict) -> str:
    """The results as a markdown table: a row per cell, model by model, full attention first, then by Q; each
    perplexity against its own weights' full attention and against the base's (what issue 16's target compares)."""
    rows = sorted(data["rows"], key=lambda r: (MODELS.index(r["model"]), -1 if r["query_tokens"] is None
                                                else r["query_tokens"]))
    full = {r["model"]: r["perplexity"] for r in rows if r["query_tokens"] is None}
    names = {("base", True): "full attention", ("retrofit", True): "retrofit weights, full attention",
             ("base", False): "NOSA untrained (A = 0)", ("retrofit", False): "NOSA retrofitted"}

    def versus(ppl: float, model: str) -> str:
        return f"{100 * (ppl / full[model] - 1):+.1f}%" if model in full else "-"

    lines = ["| model | Q | eviction | perplexity | vs own full attention | vs base full attention | locality | "
             "KB moved / token |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q, ppl = r["query_tokens"], r["perplexity"]
        cells = [names[r["model"], q is None], "-" if q is None else str(q),
                 "-" if q is None else str(r["layout"]["eviction_tokens"]), f"{ppl:.3f}",
                 "-" if q is None else versus(ppl, r["model"]), "-" if r["model"] == "base" and q is None
                 else versus(ppl, "base"), "-" if q is None else f"{r['locality']:.3f}",
                 "-" if q is None else f"{r['bytes_to_device_per_token'] / 1e3:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from hf_nosa.config import NosaConfig
    from hf_nosa.eval import evaluate, load_model
    from hf_nosa.eval.runner import budget_for, environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="the base model (a name hf_nosa.modeling.loading resolves)")
    parser.add_argument("--adapter", default=None, help="retrofit adapter folder; default the one hf_nosa ships")
    parser.add_argument("--length", type=int, default=8192, help="document length in tokens")
    parser.add_argument("--budget-ratio", type=int, default=8, help="budget = length / ratio, whole blocks")
    parser.add_argument("--local-tokens", type=int, default=None, help="local window; default budget / 4")
    parser.add_argument("--queries", default=None, help="the Q values (comma list); default 0 to budget/2 by budget/8")
    parser.add_argument("--cells", default=None, help="MODEL:full or MODEL:Q, comma list in the order to run; "
                                                      "default base then retrofit, full attention then every Q")
    parser.add_argument("--ppl-docs", type=int, default=8, help="documents (one batch)")
    parser.add_argument("--ppl-tokens", type=int, default=128, help="tokens decoded and scored per document")
    parser.add_argument("--seed", type=int, default=0, help="documents' order and the untrained heads' initialisation")
    parser.add_argument("--deadline", type=float, default=None, help="unix time by which the last cell must end")
    parser.add_argument("--results", required=True, help="JSON file: read to resume, written after every cell")
    parser.add_argument("--table", action="store_true", help="print --results as a markdown table and stop")
    args = parser.parse_args(argv)
    if args.table:  # a driver's file, or several joined as {"lengths": [...]} (docs/results keeps them so)
        data = json.loads(Path(args.results).read_text())
        for one in data.get("lengths", [data]):
            print(f"length {one['settings']['length']}, budget {one['budget_tokens']}\n{table(one)}\n")
        return 0

    for name in ("length", "budget_ratio", "ppl_docs", "ppl_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: it must be at least 1")
    block = NosaConfig().block_size
    budget = budget_for(None, args.length, None, args.budget_ratio)
    local = args.local_tokens if args.local_tokens is not None else budget // 4 // block * block
    queries = [int(q) for q in args.queries.split(",")] if args.queries else default_queries(budget, block)
    for q in queries:
        if q < 0 or q % block or block + local + q > budget:
            raise ValueError(f"--queries: Q={q} is invalid: a multiple of {block} in [0, {budget - block - local}] "
                             f"(budget {budget} - sink {block} - local {local})")
    cells = parse_cells(args.cells, queries) if args.cells else [
        (m, q) for m in MODELS for q in [None, *queries]]
    settings = dict(model=args.model, length=args.length, budget_ratio=args.budget_ratio, sink_tokens=block,
                    local_tokens=local, ppl_docs=args.ppl_docs, ppl_tokens=args.ppl_tokens, seed=args.seed,
                    dtype="float32")
    results = ResultsFile(args.results, settings)
    pending = [(m, q) for m, q in cells if not results.done(cell_name(m, q))]
    print(f"length {args.length}, budget {budget}, local {local}: running {[cell_name(*c) for c in pending]}", flush=True)
    if not pending:
        return 0

    started = time.time()
    models = {}
    base, tokenizer = load_model(args.model)  # fp32 on the CPU: the adapter merges at full precision
    if any(m == "retrofit" for m, _ in pending):
        from hf_nosa.cli.demo import SMOLLM2_ADAPTER
        from hf_nosa.training.retrofit import merge_adapter, read_run

        adapter = args.adapter or SMOLLM2_ADAPTER
        models["retrofit"] = merge_adapter(adapter, base_model=copy.deepcopy(base)).eval()
        run = read_run(adapter)
        results.update(lambda d: d.update(adapter={"steps": run.get("steps"), "nosa_config": run["nosa_config"]}))
    models["base"] = base
    # evaluate converts the base with to_nosa at its first NOSA cell; the eviction heads' delta starts random
    torch.manual_seed(args.seed)
    results.update(lambda d: d.update(environment=environment(), budget_tokens=budget, queries=queries))
    print(f"loaded in {time.time() - started:.0f}s", flush=True)

    slowest = 0.0
    for model_name, q in pending:
        cell = cell_name(model_name, q)
        if results.done(cell):  # the other process ran it meanwhile
            continue
        if args.deadline is not None and time.time() + 1.1 * slowest > args.deadline:
            why = f"{args.deadline - time.time():.0f}s left, about {1.1 * slowest:.0f}s needed"
            results.update(lambda d: d["skipped"].append({"cell": cell, "why": why}))
            print(f"skip {cell}: {why}", flush=True)
            continue
        began = time.time()
        layout = None if q is None else dict(sink_tokens=block, local_tokens=local, query_tokens=q)
        rows = evaluate(models[model_name], tokenizer, tasks=[], lengths=[args.length],
                        methods=["default" if q is None else "nosa"], budget_tokens=budget, batch_size=args.ppl_docs,
                        perplexity_docs=args.ppl_docs, perplexity_tokens=args.ppl_tokens, layout=layout,
                        seed=args.seed, show_progress=False, verbose=False)
        seconds = time.time() - began
        slowest = max(slowest, seconds)
        row = summarise(rows[0], q, model_name, seconds)
        results.update(lambda d: d["rows"].append(row))
        extra = "" if q is None else f" locality {row['locality']:.3f} {row['bytes_to_device_per_token'] / 1e3:.0f} KB/token"
        print(f"{cell}: ppl {row['perplexity']:.4f}{extra} in {seconds:.0f}s", flush=True)
    print(f"done in {time.time() - started:.0f}s; results in {args.results}", flush=True)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"query_share.py: error: {error}", file=sys.stderr)
        sys.exit(2)
