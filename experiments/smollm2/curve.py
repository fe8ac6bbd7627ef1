"""Issue 16's retrofit-steps curve: SmolLM2's long-generation perplexity, locality and bytes moved per decoded token
after N steps of the recipe's retrofit, beside full attention and NOSA untrained (A = 0), at one length and the
recipe's budget and layout (8K, budget 1,024: sink 64, local 256, query-aware 256, eviction 448).

``experiments/smollm2/gpu.sh curve`` drives it: the retrofit runs the recipe's whole schedule and stops at each N
(``hf-nosa retrofit --max-steps N``, ``--resume`` after the first stop), the adapter of each stop is kept as
``KEEP/step-N`` and measured by ``run`` while the retrofit goes on. Subcommands:

- ``run``: evaluate cells into the results file: ``full`` (full attention), ``untrained`` (``to_nosa``, A = 0),
  ``step-N`` (the adapter ``KEEP/step-N`` merged) or ``kept`` (every kept adapter not measured yet). Each cell is one
  ``hf_nosa.eval.evaluate`` call with no suite tasks: the perplexity of the same documents (seed 0), the last
  ``--ppl-tokens`` of each decoded one at a time, and ``NosaCache.stats()`` of those steps. Rows are saved as each cell
  ends, under a lock (several processes write the file); a cell that cannot end before ``--deadline`` is skipped.
- ``segment``: record a retrofit segment's wall time and rate (what ``plan`` estimates the next ones from).
- ``plan``: the step the retrofit should stop at next within the seconds left of a device call: the next point, else
  a partial stop that the next call resumes from, else none.
- ``table``: the results as the markdown table of ``docs/results.md``, and ``--png`` a plot.

Example (CPU): ``python experiments/smollm2/curve.py table --results smollm2-curve.json --png curve.png``
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, however this is loaded
from results_file import ResultsFile  # noqa: E402

LOSS_WINDOW = 10  # the LM loss of a point is the mean of its last steps': single steps vary by +-20%


def point_steps(cell: str) -> int | None:
    """``"step-25"`` -> 25; other cell names -> None."""
    name, _, steps = cell.partition("-")
    return int(steps) if name == "step" and steps.isdigit() and int(steps) > 0 else None


def parse_steps(text: str, recipe_steps: int) -> list[int]:
    """``"20 40 80"`` (spaces or commas) -> sorted distinct steps, each in [1, the recipe's steps]."""
    try:
        steps = sorted({int(s) for s in text.replace(",", " ").split()})
    except ValueError:
        raise ValueError(f"--steps {text!r} is invalid: whole numbers of retrofit steps, e.g. '20 40 80 160'") from None
    if not steps or steps[0] < 1 or steps[-1] > recipe_steps:
        raise ValueError(f"--steps {text!r} is invalid: give steps from 1 to the recipe's {recipe_steps}")
    return steps


def plain(value):
    """A value as JSON gives it back (tuples -> lists): what a saved recipe is compared with."""
    return json.loads(json.dumps(value))


class Results(ResultsFile):
    """The curve's results file: settings, rows (one per cell), skipped cells and the retrofit's segments. The
    processes that evaluate points while the retrofit goes on write it at once (``results_file``)."""

    def __init__(self, path, settings: dict):
        super().__init__(path, plain(settings), lists=("rows", "skipped", "segments"))

    def add(self, row: dict) -> None:
        """A cell's row; a cell two processes both ran keeps its first, and an earlier call's skip of it is dropped."""

        def change(data):
            if not any(r["cell"] == row["cell"] for r in data["rows"]):
                data["rows"].append(row)
            data["skipped"] = [s for s in data["skipped"] if s["cell"] != row["cell"]]

        self.update(change)


# ----- planning the retrofit's stops -----


def kept_steps(keep_dir: Path) -> list[int]:
    """The points whose adapter is kept under ``keep_dir`` (``step-N/adapter_model.safetensors``)."""
    found = [point_steps(p.name) for p in Path(keep_dir).glob("step-*") if (p / "adapter_model.safetensors").is_file()]
    return sorted(n for n in found if n is not None)


def current_step(run_dir: Path) -> int:
    """The step the retrofit in ``run_dir`` has reached: its latest checkpoint, or the adapter of a finished run."""
    run_dir = Path(run_dir)
    steps = [int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*")]
    if (run_dir / "nosa_retrofit.json").is_file():
        steps.append(json.loads((run_dir / "nosa_retrofit.json").read_text())["steps"])
    return max(steps, default=0)


def rates(data: dict, step_s: float, overhead_s: float, eval_s: float) -> tuple[float, float, float]:
    """Seconds per step, per retrofit process (loading, tokenizing, the first step's compilation, saving) and per
    evaluation process: from the last segment and the slowest cell so far, else the defaults given."""
    if data["segments"]:
        last = data["segments"][-1]
        step_s = last["step_tokens"] / last["tokens_per_second"]
        overhead_s = max(10.0, last["seconds"] - (last["to"] - last["from"]) * step_s)
    measured = [r["seconds"] + r.get("load_seconds", 0.0) for r in data["rows"]]
    return step_s, overhead_s, 1.2 * max(measured) if measured else eval_s


def plan_stop(points: list[int], current: int, measured: set[int], left: float, step_s: float, overhead_s: float,
              eval_s: float, margin: float = 15.0) -> tuple[int | None, str, str]:
    """``(stop, kind, why)``: where the retrofit (now at ``current``) should stop next in the ``left`` seconds.

    kind "point": the next point not measured or kept, when its steps and the process fit; its evaluation need not
    (``eval_s`` is only reported): the adapter is kept and returned, and the next call measures it. kind "partial":
    as far towards it as fits, when that is worth more than a process's overhead; the next call resumes there. Else
    ``(None, "", why)``.
    """
    todo = [n for n in points if n > current and n not in measured]
    lost = [n for n in points if n <= current and n not in measured]
    note = f" (steps {lost} are behind the run at {current}, and their adapters are not kept)" if lost else ""
    if not todo:
        return None, "", "every point is trained" + note
    target = todo[0]
    fits = math.floor((left - margin - overhead_s) / step_s)
    if fits >= target - current:
        return target, "point", (f"{target - current} steps, about {overhead_s + (target - current) * step_s:.0f}s "
                                 f"and {eval_s:.0f}s to evaluate, {left:.0f}s left" + note)
    if fits >= 1 and fits * step_s >= overhead_s:
        why = f"{fits} of the {target - current} steps to {target} fit in {left:.0f}s"
        return current + fits, "partial", why + note
    need = overhead_s + (target - current) * step_s
    return None, "", f"{left:.0f}s left: step {target} needs about {need:.0f}s from {current}" + note


# ----- the table and the plot -----


def ordered(rows: list[dict]) -> list[dict]:
    """Full attention, then NOSA untrained (step 0), then the points by steps."""
    return sorted(rows, key=lambda r: -1 if r["steps"] is None else r["steps"])


def versus(row: dict, full: float | None) -> str:
    return "-" if full is None or row["steps"] is None else f"{100 * (row['perplexity'] / full - 1):+.1f}%"


def tokens(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 100_000 else f"{count:,}"


def table(data: dict) -> str:
    """A row per cell: steps, tokens seen, the LM loss of the last steps, perplexity (and against full attention),
    locality and KB moved host to device per decoded token."""
    rows = ordered(data["rows"])
    full = next((r["perplexity"] for r in rows if r["steps"] is None), None)
    names = {"full": "full attention", "untrained": "NOSA untrained (A = 0)"}
    lines = [f"| model | retrofit steps | tokens seen | LM loss, last {LOSS_WINDOW} steps | perplexity | "
             "vs full attention | locality | KB moved / token |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        nosa = r["steps"] is not None
        cells = [names.get(r["cell"], "NOSA retrofitted"), "-" if not nosa else str(r["steps"]),
                 "-" if not nosa else tokens(r.get("tokens", 0)),
                 f"{r['loss']:.3f}" if r.get("loss") is not None else "-", f"{r['perplexity']:.3f}", versus(r, full),
                 f"{r['locality']:.3f}" if nosa else "-",
                 f"{r['bytes_to_device_per_token'] / 1e3:,.0f}" if nosa else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    for skip in data.get("skipped", []):
        if not any(r["cell"] == skip["cell"] for r in rows):
            lines.append(f"\n{skip['cell']}: not measured ({skip['why']})")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Perplexity, locality and KB per token against retrofit steps (0: untrained), with issue 16's targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in ordered(data["rows"]) if r["steps"] is not None]
    full = next((r["perplexity"] for r in data["rows"] if r["steps"] is None), None)
    steps = [r["steps"] for r in rows]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("perplexity", [r["perplexity"] for r in rows]), ("locality", [r["locality"] for r in rows]),
              ("KB moved / token", [r["bytes_to_device_per_token"] / 1e3 for r in rows])]
    for axis, (label, values) in zip(axes, panels):
        axis.plot(steps, values, "o-")
        axis.set_xlabel("retrofit steps (0: untrained, A = 0)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    if full is not None:
        axes[0].axhline(full, color="k", lw=1, label="full attention")
        axes[0].axhline(1.03 * full, color="g", ls="--", lw=1, label="target: +3%")
        axes[0].legend()
    axes[1].axhline(0.94, color="g", ls="--", lw=1, label="target: 0.94")
    axes[1].legend()
    s = data["settings"]
    figure.suptitle(f"SmolLM2-135M retrofit steps, {s['length']} tokens, budget {s['budget_tokens']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ----- measuring -----


def point_row(row: dict, cell: str, adapter: Path | None) -> dict:
    """The numbers of one cell, and for a point the steps, tokens and loss of its adapter's ``trainer_state.json``."""
    traffic = row.get("perplexity_traffic") or {}
    out = {"cell": cell, "steps": None if cell == "full" else point_steps(cell) or 0, "perplexity": row["perplexity"],
           "documents": row["perplexity_documents"]}
    if cell == "full":
        out["kv_bytes_read_per_token"] = row.get("kv_bytes_read_per_token")
    else:
        out.update({k: traffic[k] for k in ("locality", "bytes_to_device_per_token", "device_kv_bytes_per_sequence",
                                            "full_kv_bytes_per_sequence")})
        out["tokens"] = 0
    if adapter is not None:
        state = json.loads((adapter / "trainer_state.json").read_text())
        window = state["losses"][-LOSS_WINDOW:]
        out.update(tokens=state["tokens"], loss=sum(window) / len(window), losses=state["losses"])
    return out


def run(args, recipe: dict) -> int:
    import torch

    from hf_nosa.eval import evaluate
    from hf_nosa.eval.runner import environment
    from hf_nosa.modeling.loading import load_pretrained, load_tokenizer
    from hf_nosa.training.retrofit import merge_adapter, read_run

    started = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, run_dtype())
    results = Results(args.results, settings(args, recipe, run_dtype()))
    cells = []
    for cell in filter(None, args.cells.split(",")):
        if cell == "kept":
            cells += [f"step-{n}" for n in kept_steps(args.keep_dir)]
        elif cell in ("full", "untrained") or point_steps(cell):
            cells.append(cell)
        else:
            raise ValueError(f"--cells: {cell!r} is not full, untrained, step-N or kept")
    pending = [c for c in dict.fromkeys(cells) if not results.done(c)]
    print(f"curve: running {pending}", flush=True)
    if not pending:
        return 0
    base = load_pretrained(recipe["model"])  # fp32 on the CPU: a pristine copy for every cell, adapters merged in fp32
    tokenizer = load_tokenizer(recipe["model"])
    load_seconds = time.time() - started
    results.update(lambda d: d.update(environment=environment()))
    nosa = recipe["nosa"]
    layout = {k: nosa[k] for k in ("sink_tokens", "local_tokens", "query_tokens")}
    slowest = 0.0
    for cell in pending:
        if results.done(cell):  # another process measured it meanwhile
            continue
        if args.deadline is not None and time.time() + 1.1 * slowest > args.deadline:
            why = f"{args.deadline - time.time():.0f}s left, about {1.1 * slowest:.0f}s needed"
            results.update(lambda d: d["skipped"].append({"cell": cell, "why": why}))
            print(f"curve: skip {cell}: {why}", flush=True)
            continue
        began = time.time()
        adapter = None
        if point_steps(cell):
            adapter = Path(args.keep_dir) / cell
            run_info = read_run(adapter)
            if run_info["steps"] != point_steps(cell) or plain(run_info["recipe"]) != plain(recipe):
                raise ValueError(f"{adapter} holds {run_info['steps']} steps of another recipe or count than {cell} "
                                 f"of {args.recipe}")
            model = merge_adapter(adapter, base_model=copy.deepcopy(base))
        else:
            model = copy.deepcopy(base)
        model = model.to(device, dtype).eval()
        torch.manual_seed(args.seed)  # evaluate converts the untrained copy with to_nosa: random eviction heads
        rows = evaluate(model, tokenizer, tasks=[], lengths=[args.length],
                        methods=["default" if cell == "full" else "nosa"], budget_tokens=nosa["budget_tokens"],
                        batch_size=args.ppl_docs, perplexity_docs=args.ppl_docs, perplexity_tokens=args.ppl_tokens,
                        layout=layout, seed=args.seed, show_progress=False, verbose=False)
        seconds = time.time() - began
        slowest = max(slowest, seconds)
        row = {**point_row(rows[0], cell, adapter), "seconds": seconds, "load_seconds": load_seconds}
        results.add(row)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        extra = "" if cell == "full" else (f", locality {row['locality']:.3f}, "
                                           f"{row['bytes_to_device_per_token'] / 1e3:.0f} KB/token")
        print(f"curve: {cell}: perplexity {row['perplexity']:.4f}{extra} in {seconds:.0f}s", flush=True)
    return 0


def run_dtype() -> str:
    """The evaluation's dtype: bf16 on CUDA (the retrofit's), fp32 on the CPU."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def settings(args, recipe: dict, dtype: str) -> dict:
    return dict(model=recipe["model"], recipe=recipe, length=args.length, budget_tokens=recipe["nosa"]["budget_tokens"],
                layout={k: recipe["nosa"][k] for k in ("sink_tokens", "local_tokens", "query_tokens")},
                ppl_docs=args.ppl_docs, ppl_tokens=args.ppl_tokens, seed=args.seed, dtype=dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {name: sub.add_parser(name) for name in ("run", "segment", "plan", "table")}
    for name in ("run", "segment", "plan"):
        p = commands[name]
        p.add_argument("--recipe", default="smollm2-135m", help="the retrofit's recipe (a name or a YAML path)")
        p.add_argument("--length", type=int, default=8192, help="document length in tokens")
        p.add_argument("--ppl-docs", type=int, default=8, help="documents (one batch)")
        p.add_argument("--ppl-tokens", type=int, default=128, help="tokens decoded and scored per document")
        p.add_argument("--seed", type=int, default=0, help="the documents and the untrained heads' initialisation")
        p.add_argument("--keep-dir", default=None, help="where the points' adapters are kept (step-N)")
    for p in commands.values():
        p.add_argument("--results", required=True, help="the curve's JSON file")
    commands["run"].add_argument("--cells", required=True, help="full, untrained, step-N or kept; comma list")
    commands["run"].add_argument("--deadline", type=float, default=None, help="unix time the last cell must end by")
    for name in ("segment", "plan"):
        commands[name].add_argument("--run-dir", required=True, help="the retrofit's output folder")
    commands["segment"].add_argument("--from", dest="start", type=int, required=True, help="step it resumed from")
    commands["segment"].add_argument("--to", type=int, required=True, help="step it was to stop at")
    commands["segment"].add_argument("--seconds", type=float, required=True, help="the process's wall time")
    plan = commands["plan"]
    plan.add_argument("--steps", required=True, help="the points, e.g. '20 40 80 160'")
    plan.add_argument("--left", type=float, required=True, help="seconds left in the call")
    plan.add_argument("--step-s", type=float, default=6.0, help="seconds a step until a segment is measured")
    plan.add_argument("--overhead-s", type=float, default=60.0, help="seconds a retrofit process adds to its steps")
    plan.add_argument("--eval-s", type=float, default=90.0, help="seconds an evaluation process takes at first")
    commands["table"].add_argument("--png", default=None, help="also plot the curve into this file")
    args = parser.parse_args(argv)

    if args.command == "table":
        data = json.loads(Path(args.results).read_text())
        s = data["settings"]
        print(f"{s['length']} tokens, budget {s['budget_tokens']} ({s['layout']}), {s['ppl_docs']} documents x "
              f"{s['ppl_tokens']} decoded tokens, {s['dtype']}\n\n{table(data)}")
        if args.png:
            plot(data, Path(args.png))
        return 0
    for name in ("length", "ppl_docs", "ppl_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: it must be at least 1")
    if args.keep_dir is None and args.command != "segment":
        raise ValueError("--keep-dir is required: the folder of the kept adapters (step-N)")
    from hf_nosa.training.recipe import load_recipe

    recipe = plain(load_recipe(args.recipe))
    if args.command == "run":
        return run(args, recipe)
    results = Results(args.results, settings(args, recipe, run_dtype()))
    if args.command == "segment":
        run_info = json.loads((Path(args.run_dir) / "nosa_retrofit.json").read_text())
        if run_info["steps"] != args.to:
            raise ValueError(f"the retrofit in {args.run_dir} is at step {run_info['steps']}, not --to {args.to}")
        step_tokens = recipe["batch_size"] * recipe["seq_len"] * recipe["grad_accum"]
        segment = {"from": args.start, "to": run_info["steps"], "seconds": args.seconds, "step_tokens": step_tokens,
                   "tokens_per_second": run_info["tokens_per_second"]}
        results.update(lambda d: d["segments"].append(segment))
        print(f"curve: steps {args.start} -> {segment['to']} in {args.seconds:.0f}s, "
              f"{step_tokens / segment['tokens_per_second']:.2f}s a step", flush=True)
        return 0
    points = parse_steps(args.steps, recipe["steps"])
    measured = {r["steps"] for r in results.data["rows"] if r["steps"]} | set(kept_steps(args.keep_dir))
    current = current_step(args.run_dir)
    step_s, overhead_s, eval_s = rates(results.data, args.step_s, args.overhead_s, args.eval_s)
    stop, kind, why = plan_stop(points, current, measured, args.left, step_s, overhead_s, eval_s)
    print(f"{stop if stop is not None else '-'} {kind or '-'} {current} {why} "
          f"[{step_s:.2f}s a step, {overhead_s:.0f}s a process]")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"curve.py: error: {error}", file=sys.stderr)
        sys.exit(2)
