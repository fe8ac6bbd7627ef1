"""Run the synthetic suite and long-generation perplexity on any HF causal LM, with any cache, and ``hf-nosa eval``.

Methods (``--cache``): ``default`` (transformers' DynamicCache: full attention), ``nosa`` (NosaCache with the NOSA
rule), and the training-free baselines of ``hf_nosa.eval.baselines`` on the same NosaCache engine and budget
(``query_only``, ``quest``, ``shadowkv``). A model without eviction heads is converted with ``to_nosa`` for the
NosaCache methods (``A = 0``: NOSA untrained). Every method prefills densely and decodes the question and answer
one token at a time (see ``decode.py``), so they differ only in what decode attends to.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch

from ..cache.nosa_cache import NosaCache
from ..config import NosaConfig
from ..modeling import eviction_heads, to_nosa
from .baselines import BASELINES, make_selector
from .decode import decode
from .perplexity import long_generation_perplexity, perplexity_documents
from .ruler import postprocess
from .tasks import DEFAULT_TASKS, PROTOCOLS, TASKS, TokenCounter, generate_samples, resolve_protocol

METHODS = ("default", "nosa", *BASELINES)


# ----- models -----


def load_model(path: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A causal LM and its tokenizer from a save_pretrained folder, a Hub id, a ``.gguf`` file or ``"smollm2"``.

    NOSA checkpoints (``model_type`` llama/qwen2/qwen3 or nosa_llama/nosa_qwen2/nosa_qwen3, with a "nosa" section)
    are rebuilt as the stock family class converted by ``to_nosa`` and loaded strictly, eviction heads included.
    GGUF files are dequantised (``pip install "hf-nosa[gguf]"``); see ``hf_nosa.modeling.loading``.
    """
    from ..modeling.loading import load_causal_lm

    return load_causal_lm(path, device=device, dtype=dtype)


def nosa_layout(section, budget_tokens: int, *, sink_tokens=None, local_tokens=None, query_tokens=None) -> NosaConfig:
    """The NosaConfig of an evaluation: a model's "nosa" section (or the defaults) at ``budget_tokens``, dense prefill.

    Without a section (a model that was never trained with NOSA), the sink is one block and the local window and
    the query-aware tokens are a quarter of the budget each (whole blocks; the local window gets at least one), unless
    given.

    Args:
        section: the model's ``config.nosa`` (dict or NosaConfig) or None.
    """
    base = NosaConfig.from_dict(section.to_dict() if isinstance(section, NosaConfig) else section)
    P = base.block_size
    if budget_tokens % P or budget_tokens <= 0:
        raise ValueError(f"budget_tokens={budget_tokens} is invalid: it must be a positive multiple of block_size={P}")
    quarter = (budget_tokens // 4) // P * P
    local = min(max(P, quarter), budget_tokens - P)  # small budgets: the sink and the local window come first
    query = min(quarter, budget_tokens - P - local)
    overrides = dict(budget_tokens=budget_tokens, prefill="dense")
    for name, value, fallback in (
        ("sink_tokens", sink_tokens, P),
        ("local_tokens", local_tokens, local),
        ("query_tokens", query_tokens, query),
    ):
        if value is not None:
            overrides[name] = value
        elif section is None:
            overrides[name] = fallback
    return base.replace(**overrides)


def budget_for(section, length: int, budget_tokens: int | None, budget_ratio: int | None) -> int:
    """``budget_tokens``, else ``length / budget_ratio`` rounded down to whole blocks (at least one block)."""
    if budget_tokens is not None:
        return budget_tokens
    block = NosaConfig.from_dict(section.to_dict() if isinstance(section, NosaConfig) else section).block_size
    return max(block, length // budget_ratio // block * block)


def kv_bytes_per_token(model, context: int) -> int:
    """Bytes of K and V a full-attention decode step reads for one sequence at ``context`` tokens."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element * context


@contextlib.contextmanager
def dense_attention_outside_nosa_cache(model):
    """Within: converted layers attend fully (plus their eviction bias) when no NosaCache is used.

    A NOSA model whose config says ``prefill="nosa"`` applies the sparse training rule even with a plain cache;
    the ``default`` method must measure full attention, so its layers' configs are switched to dense meanwhile.
    """
    layers = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "nosa_config")]
    saved = [attn.nosa_config for attn in layers]
    try:
        for attn in layers:
            if attn.nosa_config.prefill == "nosa":
                attn.nosa_config = attn.nosa_config.replace(prefill="dense")
        yield model
    finally:
        for attn, cfg in zip(layers, saved):
            attn.nosa_config = cfg


def cache_factory(model, method: str, nosa_config: NosaConfig | None):
    """A function returning a fresh cache of ``method`` for one batch."""
    if method not in METHODS:
        raise ValueError(f"cache method {method!r} is unknown; allowed values are {METHODS}")
    if method == "default":
        from transformers import DynamicCache

        return lambda: DynamicCache(config=model.config)
    if not eviction_heads(model):
        raise ValueError(f"method {method!r} needs a NOSA model: convert it with hf_nosa.to_nosa first")
    if method == "nosa":
        return lambda: NosaCache(model.config, nosa_config)
    return lambda: NosaCache(model.config, nosa_config, selector=make_selector(method))


@functools.lru_cache(maxsize=4)
def _stop_ids(tokenizer) -> frozenset[int]:
    """Token ids that end an answer: EOS and every token whose text holds a newline."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    ids.update(i for i, text in enumerate(texts) if "\n" in text)
    return frozenset(ids)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end a RULER answer: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None:
                ids.add(int(i))
    return frozenset(ids)


def _answer_tokens(sample, counter: TokenCounter) -> int:
    """Tokens to generate: the answer and two more (compact), or room for RULER-style phrasing around the items."""
    if sample.metric == "exact":
        return counter.count(sample.target) + 2
    return counter.count(sample.target) + 4 * len(sample.answers) + 8


class _Traffic:
    """Host-to-device traffic and locality of NosaCache decode steps, summed over batches."""

    def __init__(self):
        self.bytes = 0
        self.tokens = 0
        self.locality_weighted = 0.0
        self.locality_steps = 0
        self.device_kv_bytes = 0
        self.full_kv_bytes = 0
        self.sequences = 0

    def add(self, cache, result, batch: int) -> None:
        if not hasattr(cache, "stats"):
            return
        stats = cache.stats()
        before = result.prefill_stats or {"bytes_to_device": 0}
        self.bytes += stats["bytes_to_device"] - before["bytes_to_device"]
        self.tokens += result.decode_steps * batch
        if result.decode_steps > 1 and stats["locality"] == stats["locality"]:
            self.locality_weighted += stats["locality"] * (result.decode_steps - 1)
            self.locality_steps += result.decode_steps - 1
        self.device_kv_bytes = max(self.device_kv_bytes, stats["device_kv_bytes"] // batch)
        self.full_kv_bytes = max(self.full_kv_bytes, stats["full_kv_bytes"] // batch)

    def summary(self) -> dict:
        if not self.tokens:
            return {}
        return {
            "bytes_to_device_per_token": self.bytes / self.tokens,
            "locality": self.locality_weighted / self.locality_steps if self.locality_steps else float("nan"),
            "device_kv_bytes_per_sequence": self.device_kv_bytes,
            "full_kv_bytes_per_sequence": self.full_kv_bytes,
        }


def evaluate_tasks(model, tokenizer, *, tasks, length: int, method: str, nosa_config, samples: int, seed: int = 0,
                   batch_size: int = 8, prefill_chunk: int = 4096, progress=None, protocol: str = "auto",
                   chat_template: bool = True, prepared: list | None = None) -> dict:
    """Accuracy per task at one length with one method: ``{"tasks": {task: acc}, "mean_accuracy", ...}``.

    Args:
        protocol: "ruler", "compact" or "auto" (``tasks.generate_samples``); chat_template: RULER prompts in the
            tokenizer's chat template.
        prepared: the samples to run (``generate_samples`` output for every task), instead of generating them here.
    """
    if prepared is None:
        prepared = [s for task in tasks for s in generate_samples(task, n=samples, length=length, tokenizer=tokenizer,
                                                                  seed=seed, protocol=protocol,
                                                                  chat_template=chat_template)]
    with _attention_for(model, method):
        return _evaluate_tasks(model, tokenizer, tasks, method, nosa_config, samples, prepared, batch_size,
                               prefill_chunk, progress)


def _attention_for(model, method: str):
    return dense_attention_outside_nosa_cache(model) if method == "default" else contextlib.nullcontext()


def _evaluate_tasks(model, tokenizer, tasks, method, nosa_config, samples, all_samples, batch_size, prefill_chunk,
                    progress) -> dict:
    make_cache = cache_factory(model, method, nosa_config)
    counter = TokenCounter(tokenizer)
    scores: dict[str, list[float]] = {task: [] for task in tasks}
    examples: dict[str, dict] = {}
    traffic = _Traffic()
    steps = 0
    for lo in range(0, len(all_samples), batch_size):
        batch = all_samples[lo : lo + batch_size]
        compact = all(s.metric == "exact" for s in batch)
        stop_ids = _stop_ids(tokenizer) if compact else _eos_ids(model, tokenizer)
        encoded = [tokenizer(s.prompt, add_special_tokens=s.add_special_tokens)["input_ids"] for s in batch]
        T = max(len(ids) for ids in encoded)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (T - len(ids)) + ids for ids in encoded])
        attention_mask = torch.tensor([[0] * (T - len(ids)) + [1] * len(ids) for ids in encoded])
        suffix = max(counter.count(s.question) for s in batch) + 1
        max_new = max(_answer_tokens(s, counter) for s in batch)
        cache = make_cache()
        result = decode(model, input_ids, attention_mask=attention_mask, cache=cache, decode_from=max(1, T - suffix),
                        max_new_tokens=max_new, stop_ids=stop_ids, prefill_chunk=prefill_chunk)
        traffic.add(cache, result, len(batch))
        steps += result.decode_steps
        for sample, row in zip(batch, result.tokens.tolist()):
            if not compact:  # what a row generates after its EOS (while others still run) is not its answer
                row = row[: next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row))]
            prediction = tokenizer.decode(row, skip_special_tokens=True)
            scores[sample.task].append(sample.score(prediction))
            shown = prediction.split("\n")[0] if sample.metric == "exact" else postprocess(prediction)
            examples.setdefault(sample.task, {"prediction": shown, "answers": list(sample.answers)})
        if progress is not None:
            progress.update(len(batch))
    per_task = {task: sum(v) / len(v) for task, v in scores.items() if v}
    return {
        "tasks": per_task,
        "mean_accuracy": sum(per_task.values()) / len(per_task) if per_task else float("nan"),
        "samples_per_task": samples,
        "decode_steps": steps,
        "examples": examples,
        **traffic.summary(),
    }


def evaluate(
    model,
    tokenizer,
    *,
    tasks=DEFAULT_TASKS,
    lengths=(4096, 8192, 16384),
    methods=METHODS,
    budget_tokens: int | None = None,
    budget_ratio: int | None = None,
    samples: int = 4,
    seed: int = 0,
    batch_size: int = 8,
    perplexity_docs: int = 4,
    perplexity_tokens: int = 128,
    prefill_chunk: int = 4096,
    layout: dict | None = None,
    protocol: str = "auto",
    chat_template: bool = True,
    show_progress: bool = True,
    verbose: bool = True,
    on_result=None,
) -> list[dict]:
    """Every (length, method) pair: task accuracy, long-generation perplexity, locality and traffic.

    Every combination of length, budget and layout, every sample and every perplexity document is prepared and
    checked before the first model call, so a bad combination fails at once with the settings to change.

    Args:
        budget_tokens: the NosaCache budget for every length; else ``length / budget_ratio`` (rounded down to
            whole blocks; ratio 8 when neither is given).
        layout: sink_tokens / local_tokens / query_tokens overrides for ``nosa_layout``.
        protocol: "ruler" (RULER's templates and scoring), "compact" (the byte-level models' format), or "auto"
            (compact for the byte-level tokenizer, RULER otherwise); see ``tasks``.
        chat_template: RULER prompts go through the tokenizer's chat template when it has one.
        verbose: print one line per result, and a table (method x task) when a length is done.
        on_result: called with each result dict as soon as it is ready (to save partial results).

    Returns:
        One dict per (length, method).
    """
    tasks, methods, lengths = list(tasks), list(methods), list(lengths)
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"task {task!r} is unknown; allowed values are {TASKS}")
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"cache method {method!r} is unknown; allowed values are {METHODS}")
    if budget_tokens is not None and budget_ratio is not None:
        raise ValueError("give at most one of budget_tokens and budget_ratio")
    if budget_tokens is None and budget_ratio is None:
        budget_ratio = 8
    if budget_ratio is not None and budget_ratio < 1:
        raise ValueError(f"budget_ratio={budget_ratio} is invalid: it must be at least 1")
    protocol = resolve_protocol(protocol, TokenCounter(tokenizer))
    section = getattr(model.config, "nosa", None)  # None: never trained with NOSA (converted here, A = 0)
    if section is not None and not eviction_heads(model):
        raise ValueError("the model config has a 'nosa' section but the model has no eviction heads; load it with load_model")
    plan = _plan(tokenizer, section, tasks=tasks, lengths=lengths, methods=methods, budget_tokens=budget_tokens,
                 budget_ratio=budget_ratio, layout=layout or {}, samples=samples, seed=seed,
                 perplexity_docs=perplexity_docs, protocol=protocol, chat_template=chat_template)
    if any(m != "default" for m in methods) and section is None:
        to_nosa(model, next(cfg for _, cfgs, _, _ in plan for cfg in cfgs.values() if cfg is not None))
    progress = _progress(show_progress, total=len(lengths) * len(methods) * len(tasks) * samples)
    results = []
    for length, configs, prepared, docs in plan:
        rows = []
        for method in methods:
            started = time.perf_counter()
            nosa_config = configs[method]
            budget = nosa_config.budget_tokens if nosa_config is not None else None
            if progress is not None:
                progress.set_description(f"{length} {method}")
            row = {"length": length, "method": method, "budget_tokens": budget, "protocol": protocol,
                   "nosa_config": nosa_config.to_dict() if nosa_config else None}
            row.update(evaluate_tasks(model, tokenizer, tasks=tasks, length=length, method=method, nosa_config=nosa_config,
                                      samples=samples, seed=seed, batch_size=batch_size, prefill_chunk=prefill_chunk,
                                      progress=progress, prepared=prepared))
            if docs:
                traffic = _Traffic()
                with _attention_for(model, method):
                    ppl = long_generation_perplexity(
                        model, [ids for _, ids in docs], make_cache=cache_factory(model, method, nosa_config),
                        generate_tokens=min(perplexity_tokens, length - 1), batch_size=batch_size,
                        prefill_chunk=prefill_chunk, on_batch=lambda cache, result: traffic.add(cache, result, result.nll.shape[0]),
                    )
                row["perplexity"] = ppl["perplexity"]
                row["perplexity_documents"] = [name for name, _ in docs]
                row["perplexity_traffic"] = traffic.summary()
            if method == "default":
                row["kv_bytes_read_per_token"] = kv_bytes_per_token(model, length)
            row["seconds"] = time.perf_counter() - started
            results.append(row)
            rows.append(row)
            if on_result is not None:
                on_result(row)
            if verbose:
                _say(progress, format_row(row))
        if verbose:
            _say(progress, "\n" + format_table(rows) + "\n")
    if progress is not None:
        progress.close()
    return results


def _say(progress, text: str) -> None:
    if progress is not None:
        progress.write(text)
    else:
        print(text, flush=True)


_LAYOUT_FLAGS = {"sink_tokens": "--sink-tokens", "local_tokens": "--local-tokens", "query_tokens": "--query-tokens"}


def check_layouts(section, *, lengths, methods, budget_tokens=None, budget_ratio=None, layout=None) -> list[dict]:
    """``{method: NosaConfig or None}`` for every length; any length whose budget and layout make no valid
    NosaConfig is an error naming the length, the settings and the ``hf-nosa eval`` flags to change.

    Args:
        section: the model's "nosa" config section, or None for a model never trained with NOSA.
    """
    layout = layout or {}
    if not lengths:
        raise ValueError("lengths must not be empty (--lengths)")
    if budget_tokens is None and budget_ratio is None:
        budget_ratio = 8
    budget_how = (f"budget_tokens={budget_tokens} (--budget {budget_tokens})" if budget_tokens is not None
                  else f"budget_ratio={budget_ratio} (--budget-ratio {budget_ratio})")
    given = ", ".join(f"{k}={v} ({_LAYOUT_FLAGS[k]} {v})" for k, v in layout.items()) or "the default layout"
    out = []
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            raise ValueError(f"length {length!r} is invalid: lengths are whole numbers of tokens, at least 2 (--lengths)")
        configs = {}
        for method in methods:
            if method == "default":
                configs[method] = None
                continue
            try:
                configs[method] = nosa_layout(section, budget_for(section, length, budget_tokens, budget_ratio), **layout)
            except (ValueError, TypeError) as error:
                raise ValueError(
                    f"length {length} with {budget_how} and {given} gives no valid NOSA layout: {error}. Change "
                    "--budget / --budget-ratio, or --sink-tokens / --local-tokens / --query-tokens, or drop this "
                    "length from --lengths") from None
        out.append(configs)
    return out


def _plan(tokenizer, section, *, tasks, lengths, methods, budget_tokens, budget_ratio, layout, samples, seed,
          perplexity_docs, protocol, chat_template) -> list:
    """``(length, {method: NosaConfig or None}, samples, perplexity documents)`` per length, every one checked.

    Raises:
        ValueError: naming the length, the budget and the settings (and the ``hf-nosa eval`` flags) to change.
    """
    layouts = check_layouts(section, lengths=lengths, methods=methods, budget_tokens=budget_tokens,
                            budget_ratio=budget_ratio, layout=layout)
    plan = []
    for length, configs in zip(lengths, layouts):
        try:
            prepared = [s for task in tasks for s in generate_samples(task, n=samples, length=length, tokenizer=tokenizer,
                                                                      seed=seed, protocol=protocol,
                                                                      chat_template=chat_template)]
        except ValueError as error:
            raise ValueError(f"{error}; change --lengths or --tasks") from None
        try:
            docs = perplexity_documents(tokenizer, length=length, n=perplexity_docs, seed=seed) if perplexity_docs else []
        except ValueError as error:
            raise ValueError(f"perplexity at length {length}: {error} (--ppl-docs, 0 skips perplexity)") from None
        plan.append((length, configs, prepared, docs))
    return plan


def _progress(show: bool, total: int):
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is then the printed rows alone
        return None
    return tqdm(total=total, unit="sample", dynamic_ncols=True)


def format_row(row: dict, label: str | None = None) -> str:
    """One line summing up a result: length, method (or ``label``), mean accuracy, perplexity, traffic, per task."""
    tasks = " ".join(f"{task}={acc:.2f}" for task, acc in row["tasks"].items())
    extra = ""
    if "perplexity" in row:
        extra += f" ppl={row['perplexity']:.3f}"
    if "locality" in row:
        extra += f" locality={row['locality']:.3f} bytes/token={row['bytes_to_device_per_token']:.0f}"
    return f"[{row['length']} {label or row['method']}] mean={row['mean_accuracy']:.3f}{extra} ({row['seconds']:.1f}s) {tasks}"


def format_table(rows: list[dict]) -> str:
    """The results of one length as a table: a row per method, a column per task, then the mean accuracy,
    perplexity, decode locality and host-to-device bytes per decoded token ("-" where a method has none)."""
    if not rows:
        return ""
    tasks = list(dict.fromkeys(task for row in rows for task in row["tasks"]))
    header = ["method", *tasks, "mean", "ppl", "locality", "bytes/token"]
    lines = []
    for row in rows:
        cells = [row["method"]] + [f"{row['tasks'][t]:.2f}" if t in row["tasks"] else "-" for t in tasks]
        cells.append(f"{row['mean_accuracy']:.3f}")
        cells.append(f"{row['perplexity']:.3f}" if "perplexity" in row else "-")
        locality = row.get("locality")
        cells.append(f"{locality:.3f}" if locality is not None and locality == locality else "-")
        moved = row.get("bytes_to_device_per_token")
        cells.append(f"{moved:,.0f}" if moved is not None else "-")
        lines.append(cells)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]

    def render(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    first = rows[0]
    budgets = sorted({row["budget_tokens"] for row in rows if row.get("budget_tokens")})
    title = f"length {first['length']}" + (f", budget {'/'.join(map(str, budgets))} tokens" if budgets else "")
    if first.get("protocol"):
        title += f", {first['protocol']} protocol"
    return "\n".join([title, render(header), render(["-" * w for w in widths]), *map(render, lines)])


def environment() -> dict:
    """Versions, device and date, for result files."""
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


# ----- the command -----


def _split_list(values: list[str]) -> list[str]:
    return [item for value in values for item in value.split(",") if item]


def _saved_nosa_section(model: str):
    """The "nosa" section of a local model folder's config.json (None for anything else), read without loading."""
    path = Path(model)
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        return json.loads(config.read_text()).get("nosa")
    return None


def run(args: argparse.Namespace) -> int:
    tasks = _split_list(args.tasks)
    if tasks == ["all"]:  # every task, the pass key included (the default leaves it out)
        tasks = list(TASKS)
    methods = _split_list(args.cache)
    try:
        lengths = [int(x) for x in _split_list(args.lengths)]
    except ValueError:
        raise ValueError(f"--lengths must be integers, got {args.lengths}") from None
    for name, value in (("--samples", args.samples), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid: it must be at least 1")
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"task {task!r} is unknown; allowed values are {TASKS}, or all (--tasks)")
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"cache method {method!r} is unknown; allowed values are {METHODS} (--cache)")
    protocol = getattr(args, "protocol", "auto")
    if protocol not in PROTOCOLS:
        raise ValueError(f"--protocol {protocol} is unknown; allowed values are {PROTOCOLS}")
    layout = {k: v for k, v in (("sink_tokens", args.sink_tokens), ("local_tokens", args.local_tokens),
                                ("query_tokens", args.query_tokens)) if v is not None}
    budget_ratio = None if args.budget is not None else (args.budget_ratio or 8)
    # every length / budget / layout combination is checked before the model is loaded
    check_layouts(_saved_nosa_section(args.model), lengths=lengths, methods=methods, budget_tokens=args.budget,
                  budget_ratio=budget_ratio, layout=layout)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    model, tokenizer = load_model(args.model, device=device, dtype=getattr(torch, dtype_name))
    out = Path(args.out) if args.out else None
    report = {"environment": environment(), "model": str(args.model), "dtype": dtype_name,
              "protocol": resolve_protocol(protocol, TokenCounter(tokenizer)),
              "chat_template": not getattr(args, "no_chat_template", False), "results": []}

    def save(row):
        report["results"].append(row)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2))

    evaluate(model, tokenizer, tasks=tasks, lengths=lengths, methods=methods, budget_tokens=args.budget,
             budget_ratio=budget_ratio, samples=args.samples, seed=args.seed, batch_size=args.batch_size,
             perplexity_docs=args.ppl_docs, perplexity_tokens=args.ppl_tokens, layout=layout, protocol=protocol,
             chat_template=not getattr(args, "no_chat_template", False), show_progress=not args.no_progress,
             on_result=save)
    if out is not None:
        print(f"results written to {out}")
    return 0
