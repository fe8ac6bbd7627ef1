"""What a request stream's rows say beside the measurements (``benchmarks/serve.py``): each method's numbers at
saturation, the floor analysis of what bounds each method, and the plot of tok/s and latencies against the offered
load."""

from __future__ import annotations

from benchmarks.harness import pyplot, save_figure


def floor_analysis(model, lengths: list[int], new_tokens: int, cap_gb: float | None, budget_tokens: int,
                   locality: float | None, pcie_gb_s: float = 51.0, hbm_tb_s: float = 3.35) -> dict:
    """What bounds each method, by arithmetic (issue: stock's concurrency is about free device memory / (context x
    bytes per token); NOSA's step is about batch x (1 - locality) x budget x bytes per token over PCIe plus the
    budget's KV over HBM). ``pcie_gb_s``: the host-to-device rate measured for block fetches (facts.md); ``hbm_tb_s``:
    an H100's HBM3. Per decode step and sequence, at the stream's mean context."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    kv_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * itemsize  # K and V, every layer
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    context = sum(lengths) / len(lengths) + new_tokens / 2
    free = cap_gb * 1e9 - weights if cap_gb else None
    miss = 1.0 - (locality if locality is not None and locality == locality else 0.0)
    return dict(
        kv_bytes_per_token=kv_token, weights_bytes=weights, mean_context=context, pcie_gb_s=pcie_gb_s,
        hbm_tb_s=hbm_tb_s,
        stock_max_concurrency=(free / (context * kv_token)) if free else None,
        stock_step_s_per_sequence=context * kv_token / (hbm_tb_s * 1e12),
        nosa_fetch_s_per_sequence=miss * budget_tokens * kv_token / (pcie_gb_s * 1e9),
        nosa_attention_s_per_sequence=budget_tokens * kv_token / (hbm_tb_s * 1e12),
        locality_used=1.0 - miss,
    )


def saturation(rows: list[dict]) -> dict:
    """A method's numbers at saturation: its largest output tok/s over the offered loads (and that load), the
    largest admitted concurrency, and the p50 / p99 latencies and memory of that load's row."""
    best = max(rows, key=lambda r: r["output_tok_s"])
    keys = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "host_peak_rss_bytes",
            "pinned_peak_bytes", "device_peak_bytes", "locality")
    return dict(rate=best["rate"], max_decoding=max(r["max_decoding"] for r in rows),
                max_admitted=max(r.get("max_admitted", 0) for r in rows),
                **{k: best.get(k) for k in keys})


def plot_stream(rows: list[dict], path) -> bool:
    """Output tok/s, p50 TTFT and p50 TPOT against the offered load, one line per method, as a PNG at ``path``;
    False (nothing drawn) without matplotlib. The ``inf`` load is drawn at twice the largest finite one (ticked
    "inf")."""
    plt = pyplot()
    if plt is None:
        return False
    rates = [r["rate"] for row in rows for r in row["rates"]]
    finite = [r for r in rates if r != float("inf")]
    at_inf = 2 * max(finite) if finite else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("output_tok_s", "output tok/s"), ("ttft_p50_s", "p50 time to first token (s)"),
              ("tpot_p50_s", "p50 time per output token (s)"))
    for ax, (key, label) in zip(axes, panels):
        for row in rows:
            points = sorted((at_inf if r["rate"] == float("inf") else r["rate"], r[key]) for r in row["rates"]
                            if r.get(key) is not None)
            if points:
                ax.plot(*zip(*points), marker="o", label=row["method"])
        if finite and max(finite) > 4 * min(finite):  # loads are swept by factors: even steps on a log axis
            ax.set_xscale("log")
            ax.minorticks_off()  # the loads themselves are the ticks
        ticks = sorted(set(finite)) + ([at_inf] if len(finite) < len(rates) else [])
        ax.set_xticks(ticks, [f"{x:g}" for x in sorted(set(finite))] + ["inf"] * (len(ticks) - len(set(finite))))
        ax.set_xlabel("offered load (requests/s; inf: all at once)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    save_figure(fig, path)
    return True
