"""Plots (PNG) and a markdown table from a quality run's results.json.

    python experiments/quality/report.py DIR      # writes DIR/accuracy.png, DIR/traffic.png, DIR/results.md
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ORDER = ["full_attention", "nosa", "nosa_untrained", "query_only", "quest", "shadowkv",
         "nosa_retrofit_full_attention", "base_full_attention"]
NAMES = {
    "full_attention": "Full attention",
    "nosa": "NOSA (retrofit)",
    "nosa_untrained": "NOSA untrained (A=0)",
    "query_only": "Query-only (InfLLMv2-style)",
    "quest": "Quest",
    "shadowkv": "ShadowKV-style",
    "nosa_retrofit_full_attention": "NOSA retrofit, full attention",
    "base_full_attention": "Pretrained base, full attention",
}


def _rows(results: dict) -> list[dict]:
    rows = results.get("evaluation", [])
    return sorted(rows, key=lambda r: (r["length"], ORDER.index(r["label"]) if r["label"] in ORDER else 99))


def _metric(row: dict, key: str):
    """A row's value; full attention's traffic is its whole KV cache per token (what offloading it would move)."""
    if key == "bytes_to_device_per_token" and row.get(key) is None:
        return row.get("kv_bytes_read_per_token")
    return row.get(key)


def _fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    rows = _rows(results)
    if not rows:
        return "No evaluation rows.\n"
    tasks = list(rows[0]["tasks"])
    lines = []
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        budget = next((r["budget_tokens"] for r in at if r.get("budget_tokens")), None)
        lines.append(f"### {length} tokens" + (f", budget {budget} tokens ({length // budget}x)" if budget else ""))
        lines.append("")
        lines.append("| method | mean | " + " | ".join(tasks) + " | perplexity | locality | KB to device / token |")
        lines.append("|---|---|" + "---|" * len(tasks) + "---|---|---|")
        for r in at:
            kb = _metric(r, "bytes_to_device_per_token")
            traffic = _fmt(kb / 1e3 if kb is not None else None, 1)
            if r.get("bytes_to_device_per_token") is None and kb is not None:
                traffic += " *"
            cells = [NAMES.get(r["label"], r["label"]), _fmt(r["mean_accuracy"])]
            cells += [_fmt(r["tasks"].get(t), 2) for t in tasks]
            cells += [_fmt(r.get("perplexity")), _fmt(r.get("locality")), traffic]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("\\* full attention reads its whole KV cache every step: what offloading it would move per token.")
        lines.append("")
    summary = results.get("summary", {})
    if summary:
        lines.append("Targets:")
        lines.append("")
        for length, entry in summary.items():
            for name, value in entry.get("targets", {}).items():
                lines.append(f"- {length}: {name} = {_fmt(value) if isinstance(value, float) else value}")
        lines.append("")
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(results)
    if not rows:
        return []
    lengths = sorted({r["length"] for r in rows})
    tasks = list(rows[0]["tasks"])
    written = []

    fig, axes = plt.subplots(1, len(lengths), figsize=(7 * len(lengths), 4.5), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        at = [r for r in rows if r["length"] == length]
        width = 0.8 / max(1, len(at))
        for i, r in enumerate(at):
            values = [r["tasks"].get(t, 0.0) for t in tasks] + [r["mean_accuracy"]]
            ax.bar([x + i * width for x in range(len(values))], values, width, label=NAMES.get(r["label"], r["label"]))
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(tasks) + 1)])
        ax.set_xticklabels(tasks + ["MEAN"], rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"accuracy at {length} tokens")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    labels = [label for label in ORDER if any(r["label"] == label for r in rows)]
    labels += sorted({r["label"] for r in rows} - set(labels))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(lengths)
    metrics = (("perplexity", 1, "long-generation perplexity"), ("locality", 1, "decode locality"),
               ("bytes_to_device_per_token", 1e3, "KB host->device per decoded token"))
    for ax, (key, scale, title) in zip(axes, metrics):
        for i, length in enumerate(lengths):
            at = {r["label"]: r for r in rows if r["length"] == length}
            values = [(_metric(at[label], key) or float("nan")) / scale if label in at else float("nan") for label in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=f"{length} tokens")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels([NAMES.get(label, label) for label in labels], rotation=45, ha="right", fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_title("KB host->device per decoded token\n(full attention: its whole KV, were it offloaded)", fontsize=9)
    fig.tight_layout()
    path = out / "traffic.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def write_report(out: Path) -> None:
    """results.md, then the plots (matplotlib may be missing where the run happened: rerun this script elsewhere)."""
    out = Path(out)
    results = json.loads((out / "results.json").read_text())
    (out / "results.md").write_text(markdown(results))
    plots(results, out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: report.py RUN_DIR")
    write_report(Path(sys.argv[1]))
