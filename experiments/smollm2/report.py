"""Issue 16's SmolLM2 results as docs: the markdown tables and target checks, one JSON and the plots.

    python experiments/smollm2/report.py RESULTS.json [RESULTS.json ...] --adapter ADAPTER.tar|DIR \
        --out-dir docs/results --prefix smollm2-gpu [--md section.md] [--not-run LENGTH=REASON ...]

RESULTS are the per-length files of ``experiments/smollm2/evaluate.py`` (``smollm2-4096.json``, ...); the adapter
(``adapter.tar`` of ``gpu.sh retrofit``, or its folder) gives the retrofit's run and loss curve. Writes
``PREFIX.json`` (everything, one file), ``PREFIX-accuracy.png``, ``PREFIX-traffic.png`` and, with an adapter,
``PREFIX-retrofit.png`` under ``--out-dir``, and prints the section's markdown (or writes it to ``--md``).

A cell of the table that a results file lacks is listed as not run, with the reason: the driver's own (``skipped``
for time) or, for a process that ended before the cell, the one given with ``--not-run LENGTH=REASON``; it is never
filled in. The reasons go into ``PREFIX.json`` too (``not_run`` of each length).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

LABELS = {  # cell -> row label, in the order the tables list them
    "base:default": "full attention",
    "retrofit:nosa": "NOSA retrofitted",
    "base:nosa": "NOSA untrained (A = 0)",
    "base:query_only": "query-only",
    "base:quest": "Quest",
    "base:shadowkv": "ShadowKV",
    "retrofit:default": "retrofit weights under full attention",
}
TRAINING_FREE = ("base:nosa", "base:query_only", "base:quest", "base:shadowkv")
SHORT = {"niah_single_number": "s-num", "niah_single_uuid": "s-uuid", "niah_multikey_number": "mk-num",
         "niah_multikey_uuid": "mk-uuid", "niah_multivalue": "m-value", "niah_multiquery": "m-query", "vt": "vt",
         "passkey": "passkey", "cwe": "cwe"}


def read_adapter(path: Path | None) -> dict:
    """``{"run": nosa_retrofit.json, "losses": [...]}`` from an adapter folder or ``adapter.tar`` ({} for None)."""
    if path is None:
        return {}
    files = {}
    if path.is_dir():
        for name in ("nosa_retrofit.json", "trainer_state.json"):
            if (path / name).is_file():
                files[name] = json.loads((path / name).read_text())
    else:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in ("nosa_retrofit.json", "trainer_state.json"):
                    files[name] = json.load(tar.extractfile(member))
    if "nosa_retrofit.json" not in files:
        raise ValueError(f"{path} holds no nosa_retrofit.json: not a retrofit adapter")
    run = {k: v for k, v in files["nosa_retrofit.json"].items()}
    return {"run": run, "losses": files.get("trainer_state.json", {}).get("losses", [])}


def load_results(paths: list[Path]) -> list[dict]:
    """The per-length results, sorted by length; every file must hold one length."""
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        if "settings" not in data or "cells" not in data:
            raise ValueError(f"{path} is not a results file of experiments/smollm2/evaluate.py")
        out.append(data)
    return sorted(out, key=lambda d: d["settings"]["length"])


def _fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def parse_not_run(items: list[str]) -> dict[int, str]:
    """``["8192=the process crashed"]`` -> ``{8192: "the process crashed"}``."""
    out = {}
    for item in items:
        length, sep, why = item.partition("=")
        if not sep or not length.strip().isdigit() or not why.strip():
            raise ValueError(f"--not-run must be LENGTH=REASON (e.g. 8192=the process crashed), got {item!r}")
        out[int(length)] = why.strip()
    return out


def not_run(data: dict, why: str | None = None) -> list[dict]:
    """The table's cells missing from ``data``, each ``{"cell", "why"}``: the driver's reason when it skipped the
    cell, else ``why`` (the caller's: e.g. the process ended before the cell), else that the file lacks it."""
    rows = {row["cell"] for row in data["cells"]}
    skipped = {x["cell"]: f"skipped for time: {x['why']}" for x in data.get("skipped") or []}
    return [{"cell": cell, "why": skipped.get(cell) or why or "not in the results file"}
            for cell in LABELS if cell not in rows]


def _mb(value) -> str:
    return _fmt(None if value is None else value / 1e6, ".2f")


def table(data: dict, why: str | None = None) -> str:
    """One length's markdown table: a row per cell, a column per task, then mean, perplexity, locality, traffic;
    a cell the file lacks gets a "not run" row and its reason below the table (``why``: see ``not_run``)."""
    settings = data["settings"]
    rows = {row["cell"]: row for row in data["cells"]}
    tasks = list(settings["tasks"])
    header = ["method", *[SHORT.get(t, t) for t in tasks], "mean", "perplexity", "locality", "MB moved / token"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell, label in LABELS.items():
        row = rows.get(cell)
        if row is None:
            lines.append("| " + " | ".join([label, *["-"] * len(tasks), "not run", "-", "-", "-"]) + " |")
            continue
        if row.get("resident_margin") and row.get("method") != "default":  # a decode setting: say it on the row
            label = f"{label}, resident margin {row['resident_margin']:g}"
        cells = [label, *[_fmt(row["tasks"].get(t), ".2f") for t in tasks], f"**{row['mean_accuracy']:.3f}**",
                 _fmt(row.get("perplexity"), ".3f"), _fmt(row.get("locality"), ".3f"),
                 _mb(row.get("bytes_to_device_per_token"))]
        lines.append("| " + " | ".join(cells) + " |")
    missing = not_run(data, why)
    if missing:
        reasons: dict[str, list[str]] = {}
        for x in missing:
            reasons.setdefault(x["why"], []).append(LABELS[x["cell"]])
        lines.append("\nNot run at this length: " + "; ".join(f"{', '.join(cells)} ({why})"
                                                            for why, cells in reasons.items()) + ".")
    return "\n".join(lines)


def targets(data: dict) -> list[str]:
    """Issue 16's targets for the retrofitted model at this length, each with its numbers and met / not met."""
    rows = {row["cell"]: row for row in data["cells"]}
    full, ours = rows.get("base:default"), rows.get("retrofit:nosa")
    if full is None or ours is None:
        return ["targets: full attention and the retrofitted NOSA are both needed"]
    out = []

    def line(text: str, met: bool | None) -> None:
        out.append(f"- {text}: {'met' if met else 'not met' if met is not None else 'not measured'}")

    if "perplexity" in full and "perplexity" in ours:
        ratio = ours["perplexity"] / full["perplexity"] - 1
        line(f"long-generation perplexity within 3% of full attention: {ours['perplexity']:.3f} against "
             f"{full['perplexity']:.3f} ({100 * ratio:+.1f}%)", ratio <= 0.03)
    share = ours["mean_accuracy"] / full["mean_accuracy"] if full["mean_accuracy"] else float("nan")
    line(f"suite mean at least 95% of full attention: {ours['mean_accuracy']:.3f} against {full['mean_accuracy']:.3f} "
         f"({100 * share:.0f}%)", share >= 0.95)
    free = {LABELS[c]: rows[c]["mean_accuracy"] for c in TRAINING_FREE if c in rows}
    absent = [LABELS[c] for c in TRAINING_FREE if c not in rows]
    if free:
        best = max(free, key=free.get)
        text = (f"suite mean at or above the best training-free method ({best}, {free[best]:.3f}"
                f"{' of those run; ' + ', '.join(absent) + ' not run' if absent else ''}): {ours['mean_accuracy']:.3f}")
        # below one measured baseline decides it; at or above them all decides nothing while some did not run
        above = ours["mean_accuracy"] >= free[best]
        line(text, None if above and absent else above)
    locality = ours.get("locality")
    line(f"locality at least 0.94: {_fmt(locality, '.3f')}", None if locality is None else locality >= 0.94)
    query = rows.get("base:query_only")
    if query is not None and "bytes_to_device_per_token" in ours:
        a, b = ours["bytes_to_device_per_token"], query["bytes_to_device_per_token"]
        line(f"bytes moved per token below query-only's: {_mb(a)} MB against {_mb(b)} MB", a < b)
    return out


def describe(results: list[dict], adapter: dict, why: dict[int, str] | None = None) -> str:
    """The section body: settings, the retrofit run, a table per length, the targets at the longest length
    (``why``: length -> reason for the cells its file lacks, see ``not_run``)."""
    why = why or {}
    first = results[0]
    env, settings = first.get("environment", {}), first["settings"]
    parts = [
        f"{env.get('device', '?')}, torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, "
        f"{env.get('date', '?')[:10]}; {first.get('dtype', '?')}, greedy; {settings['samples']} samples per task (seed {settings['seed']}), "
        f"RULER protocol {'in the chat template' if settings['chat_template'] else 'as plain text'}; perplexity over "
        f"{settings['ppl_docs']} documents x {settings['ppl_tokens']} decoded tokens; budget = context / "
        f"{settings['budget_ratio']} for every NosaCache method, the same layout for all of one length (below); dense "
        f"prefill, then decode through the cache."
    ]
    if adapter:
        run = adapter["run"]
        recipe = run["recipe"]
        text = (f"Retrofit: {run['steps']} steps (the recipe: {recipe['steps']}) of "
                f"{recipe['grad_accum'] * recipe['batch_size']} x {recipe['seq_len']} tokens "
                f"({run['tokens_per_second']:,.0f} tokens/s), final loss {run['final_loss']:.3f}")
        if run.get("schedule_steps"):
            text += (f"; time limit {run['time_limit_s']:.0f} s, learning-rate schedule planned for "
                     f"{run['schedule_steps']} steps")
        losses = adapter.get("losses") or []
        if len(losses) >= 10:
            text += f"; mean loss of the first / last 10 steps {sum(losses[:10]) / 10:.3f} / {sum(losses[-10:]) / 10:.3f}"
        parts.append(text + ".")
    for data in results:
        s = data["settings"]
        layout = data["layout"]
        parts.append(f"**{s['length']} tokens, budget {data['budget_tokens']}** (sink {layout['sink_tokens']}, local "
                     f"{layout['local_tokens']}, query-aware {layout['query_tokens']} tokens)\n\n"
                     f"{table(data, why.get(s['length']))}")
    last = results[-1]
    parts.append(f"Targets at {last['settings']['length']} tokens:\n\n" + "\n".join(targets(last)))
    parts.append("Task columns: " + ", ".join(f"{v} = {k}" for k, v in SHORT.items() if k in settings["tasks"]) + ".")
    return "\n\n".join(parts) + "\n"


def plots(results: list[dict], adapter: dict, out_dir: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, data in zip(axes[0], results):
        rows = {row["cell"]: row for row in data["cells"]}
        cells = list(LABELS)  # every row, so that a cell that did not run shows as such rather than vanishing
        ax.barh([LABELS[c] for c in cells], [rows[c]["mean_accuracy"] if c in rows else 0.0 for c in cells],
                color=["#555" if c.endswith(":default") else "#c44" if c == "retrofit:nosa" else "#48a" for c in cells])
        for y, cell in enumerate(cells):
            if cell not in rows:
                ax.text(0.01, y, "not run", va="center", fontsize=8, color="#888")
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_title(f"{data['settings']['length']} tokens, budget {data['budget_tokens']}")
        ax.set_xlabel("suite mean accuracy")
    fig.tight_layout()
    written.append(out_dir / f"{prefix}-accuracy.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for data, marker in zip(results, "os^"):
        for row in data["cells"]:
            if row.get("bytes_to_device_per_token") is None or row.get("locality") is None:
                continue
            ax.scatter(row["bytes_to_device_per_token"] / 1e6, row["locality"], marker=marker,
                       color="#c44" if row["cell"] == "retrofit:nosa" else "#48a")
            ax.annotate(f"{LABELS[row['cell']]} ({data['settings']['length']})",
                        (row["bytes_to_device_per_token"] / 1e6, row["locality"]), fontsize=7)
    ax.set_xlabel("MB moved host -> device per decoded token")
    ax.set_ylabel("locality")
    fig.tight_layout()
    written.append(out_dir / f"{prefix}-traffic.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    losses = adapter.get("losses") if adapter else None
    if losses:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(losses) + 1), losses, color="#48a", alpha=0.6, label="each step (8 sequences)")
        if len(losses) >= 10:  # a step's loss depends on its 8 sequences; the running mean shows the trend
            ax.plot(range(10, len(losses) + 1), [sum(losses[i - 10:i]) / 10 for i in range(10, len(losses) + 1)],
                    color="#c44", label="mean of the last 10 steps")
            ax.legend(fontsize=8)
        ax.set_xlabel("retrofit step")
        ax.set_ylabel("language-model loss")
        ax.set_title("retrofit (the alignment losses are not included)", fontsize=9)
        fig.tight_layout()
        written.append(out_dir / f"{prefix}-retrofit.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="per-length results of evaluate.py")
    parser.add_argument("--adapter", type=Path, default=None, help="adapter.tar or adapter folder of the retrofit")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/results"))
    parser.add_argument("--prefix", default="smollm2-gpu")
    parser.add_argument("--md", type=Path, default=None, help="write the markdown here instead of printing it")
    parser.add_argument("--not-run", action="append", default=[], metavar="LENGTH=REASON",
                        help="why that length's file lacks some cells (e.g. the process crashed); repeatable")
    args = parser.parse_args(argv)
    why = parse_not_run(args.not_run)
    results = load_results(args.results)
    unknown = sorted(set(why) - {data["settings"]["length"] for data in results})
    if unknown:
        raise ValueError(f"--not-run names lengths no results file holds: {unknown}")
    adapter = read_adapter(args.adapter)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for data in results:
        data["not_run"] = not_run(data, why.get(data["settings"]["length"]))
        env = data.get("environment") or {}
        if isinstance(env.get("command"), str):  # the device's absolute paths mean nothing in the docs: file names
            env["command"] = " ".join(Path(x).name if x.startswith("/") else x for x in env["command"].split())
    combined = {"adapter": adapter, "lengths": results}
    (args.out_dir / f"{args.prefix}.json").write_text(json.dumps(combined, indent=1))
    written = plots(results, adapter, args.out_dir, args.prefix)
    text = describe(results, adapter, why)
    # docs/results.md links its images relative to docs/
    text += "\n" + "\n".join(f"![{p.stem}](results/{p.name})" for p in written) + "\n"
    if args.md:
        args.md.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"report.py: error: {error}", file=sys.stderr)
        sys.exit(2)
