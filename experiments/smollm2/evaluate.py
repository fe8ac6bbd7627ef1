"""One length of issue 16's SmolLM2 table: every cell through ``hf_nosa.eval.evaluate``, saved as it ends, in time.

A cell is ``MODEL:METHOD``. MODEL is ``base`` (SmolLM2-135M-Instruct; ``evaluate`` converts it with ``to_nosa``,
A = 0, for the NosaCache methods: "NOSA untrained") or ``retrofit`` (the base with the retrofit adapter merged by
``hf_nosa.training.retrofit.merge_adapter``: LoRA and trained eviction heads). METHOD is one of ``hf_nosa.eval.METHODS``:
``default`` (full attention; for ``retrofit`` the merged weights with the eviction bias, under full attention),
``nosa``, ``query_only``, ``quest``, ``shadowkv``.

Every NosaCache cell of both models uses the same budget (length / ratio, whole blocks) and the evaluation's
default layout at that budget (one sink block, a quarter local window, a quarter query-aware, the rest chosen by
the eviction score), so the retrofitted model is measured under the split the untrained one gets (at 8K and
ratio 8 it is also the recipe's). Each task's samples form one batch (decode is host-bound: a batch of 16 costs
about what one sample costs).

Cells run in the order given. Before each, the slowest cell so far says whether it can end before ``--deadline``;
one that cannot is skipped and listed, and a later call continues: cells already in ``--results`` are not rerun.

Example (CPU, toy sizes):
    python experiments/smollm2/evaluate.py --length 1024 --cells base:default,base:nosa --samples 1 \
        --ppl-docs 1 --ppl-tokens 8 --tasks passkey --results /tmp/smollm2-1024.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

MODELS = ("base", "retrofit")
SETTINGS = ("model", "length", "tasks", "samples", "budget_ratio", "seed", "ppl_docs", "ppl_tokens", "chat_template")


def parse_cells(text: str, methods) -> list[tuple[str, str]]:
    """``"base:default,retrofit:nosa"`` -> ``[("base", "default"), ("retrofit", "nosa")]``, checked."""
    cells = []
    for item in filter(None, text.split(",")):
        model, _, method = item.partition(":")
        if model not in MODELS or method not in methods:
            raise ValueError(f"--cells: {item!r} is not MODEL:METHOD with MODEL in {MODELS} and METHOD in {methods}")
        cells.append((model, method))
    if not cells:
        raise ValueError("--cells is empty")
    return cells


def parse_tasks(text: str, tasks) -> list[str]:
    chosen = list(tasks) if text == "all" else [t for t in text.split(",") if t]
    unknown = [t for t in chosen if t not in tasks]
    if unknown or not chosen:
        raise ValueError(f"--tasks: {unknown or text!r} unknown; give 'all' or a comma list of {tasks}")
    return chosen


@contextlib.contextmanager
def prompts_built_once():
    """``evaluate`` builds a length's prompts and perplexity documents on every call; one call per cell would
    rebuild the same ones (tens of seconds at 8K), so within this block they are built once per arguments."""
    from hf_nosa.eval import runner

    originals = runner.generate_samples, runner.perplexity_documents
    memo: dict = {}

    def plain(value):  # the tokenizer is the same object throughout: its identity stands for it
        return value if isinstance(value, (str, int, float, bool, type(None))) else id(value)

    def once(function):
        def call(*args, **kwargs):
            key = (function.__name__, *map(plain, args), *sorted((k, plain(v)) for k, v in kwargs.items()))
            if key not in memo:
                memo[key] = function(*args, **kwargs)
            return memo[key]

        return call

    runner.generate_samples, runner.perplexity_documents = map(once, originals)
    try:
        yield
    finally:
        runner.generate_samples, runner.perplexity_documents = originals


class Results:
    """The results file of one length: settings, the adapter's run, the cells done and those skipped."""

    def __init__(self, path: Path, settings: dict):
        self.path = path
        self.data = {"settings": settings, "cells": [], "skipped": []}
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved["settings"] != settings:
                changed = sorted(k for k in settings if saved["settings"].get(k) != settings[k])
                raise ValueError(f"{path} holds cells run with other settings ({changed}); give another --results")
            self.data = saved
        self.data["skipped"] = []

    def done(self, cell: str) -> bool:
        return any(row["cell"] == cell for row in self.data["cells"])

    def add(self, row: dict) -> None:
        self.data["cells"].append(row)
        self.save()

    def skip(self, cell: str, why: str) -> None:
        self.data["skipped"].append({"cell": cell, "why": why})
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=1))
        os.replace(partial, self.path)


def estimate(seconds: dict[str, float], method: str) -> float:
    """Seconds a cell may take: the slowest cell so far of the same kind (full attention or a NosaCache method)."""
    same = [s for m, s in seconds.items() if (m == "default") == (method == "default")]
    return 1.15 * max(same or list(seconds.values()) or [0.0])


def main(argv=None) -> int:
    from hf_nosa.eval import METHODS, TASKS, evaluate
    from hf_nosa.eval.runner import budget_for, environment, nosa_layout

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="the base model (a name hf_nosa.modeling.loading resolves)")
    parser.add_argument("--adapter", default=None, help="retrofit adapter folder (needed by retrofit:* cells)")
    parser.add_argument("--length", type=int, required=True, help="prompt length in tokens")
    parser.add_argument("--cells", required=True, help="MODEL:METHOD,... in the order to run")
    parser.add_argument("--tasks", default="all", help=f"'all' or a comma list of {', '.join(TASKS)}")
    parser.add_argument("--samples", type=int, default=16, help="samples per task (one batch per task)")
    parser.add_argument("--budget-ratio", type=int, default=8, help="budget = length / ratio, whole blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ppl-docs", type=int, default=8, help="documents for long-generation perplexity; 0: none")
    parser.add_argument("--ppl-tokens", type=int, default=128, help="tokens decoded and scored per document")
    parser.add_argument("--no-chat-template", action="store_true", help="RULER prompts as plain text")
    parser.add_argument("--deadline", type=float, default=None, help="unix time by which the last cell must end")
    parser.add_argument("--results", required=True, help="JSON file: read to resume, written after every cell")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ...; auto: cuda when present")
    parser.add_argument("--resident-margin", type=float, default=None,
                        help="NosaConfig.resident_margin of the retrofit:* cells (0: the stateless rule; default: the "
                             "adapter's, as the demo decodes); recorded in their rows")
    args = parser.parse_args(argv)

    cells = parse_cells(args.cells, METHODS)
    tasks = parse_tasks(args.tasks, TASKS)
    for name in ("samples", "budget_ratio", "length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: it must be at least 1")
    if any(model == "retrofit" for model, _ in cells) and not args.adapter:
        raise ValueError("retrofit:* cells need --adapter (the folder hf-nosa retrofit wrote)")
    settings = dict(model=args.model, length=args.length, tasks=tasks, samples=args.samples,
                    budget_ratio=args.budget_ratio, seed=args.seed, ppl_docs=args.ppl_docs, ppl_tokens=args.ppl_tokens,
                    chat_template=not args.no_chat_template)
    results = Results(Path(args.results), settings)
    pending = [(m, method) for m, method in cells if not results.done(f"{m}:{method}")]
    print(f"length {args.length}: {len(cells) - len(pending)} cells done before, running {pending}", flush=True)
    if not pending:
        return 0

    from hf_nosa.modeling.loading import load_pretrained, load_tokenizer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    started = time.time()
    base = load_pretrained(args.model)  # fp32 on the CPU: the adapter merges at full precision
    tokenizer = load_tokenizer(args.model)
    models, margins = {}, {}
    if any(m == "retrofit" for m, _ in pending):
        from hf_nosa import NosaConfig
        from hf_nosa.training.retrofit import merge_adapter, read_run

        models["retrofit"] = merge_adapter(args.adapter, base_model=copy.deepcopy(base)).to(device, dtype).eval()
        section = NosaConfig.from_model_config(models["retrofit"].config)
        if args.resident_margin is not None:
            section = section.replace(resident_margin=args.resident_margin)
        models["retrofit"].config.nosa = section.to_dict()
        margins["retrofit"] = section.resident_margin
        results.data["adapter"] = {k: v for k, v in read_run(args.adapter).items() if k != "recipe"}
    models["base"] = base.to(device, dtype).eval()
    budget = budget_for(None, args.length, None, args.budget_ratio)
    default = nosa_layout(None, budget)
    layout = {k: getattr(default, k) for k in ("sink_tokens", "local_tokens", "query_tokens")}
    results.data["environment"] = environment()
    results.data["dtype"] = str(dtype).removeprefix("torch.")
    results.data["budget_tokens"], results.data["layout"] = budget, layout
    print(f"loaded in {time.time() - started:.0f}s on {device}; budget {budget} tokens, layout {layout}", flush=True)

    seconds: dict[str, float] = {}
    with prompts_built_once():
        for model_name, method in pending:
            cell = f"{model_name}:{method}"
            need = estimate(seconds, method)
            if args.deadline is not None and time.time() + need > args.deadline:
                results.skip(cell, f"{args.deadline - time.time():.0f}s left, about {need:.0f}s needed")
                print(f"skip {cell}: {results.data['skipped'][-1]['why']}", flush=True)
                continue
            began = time.time()
            rows = evaluate(models[model_name], tokenizer, tasks=tasks, lengths=[args.length], methods=[method],
                            budget_ratio=args.budget_ratio, samples=args.samples, seed=args.seed,
                            batch_size=args.samples, perplexity_docs=args.ppl_docs, perplexity_tokens=args.ppl_tokens,
                            layout=layout, protocol="ruler", chat_template=not args.no_chat_template,
                            show_progress=False, verbose=True)
            seconds[method] = time.time() - began
            # a decode setting: full attention ("default") has none
            margin = None if method == "default" else margins.get(model_name, 0.0)
            for row in rows:
                results.add({"cell": cell, "model": model_name, **row, "cell_seconds": seconds[method],
                             "resident_margin": margin})
            print(f"cell {cell} {args.length}: mean {rows[0]['mean_accuracy']:.3f} in {seconds[method]:.0f}s", flush=True)
    print(f"length {args.length} done in {time.time() - started:.0f}s; results in {args.results}", flush=True)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"evaluate.py: error: {error}", file=sys.stderr)
        sys.exit(2)
