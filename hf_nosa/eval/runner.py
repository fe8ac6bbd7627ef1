"""Run the synthetic suite and long-generation perplexity on any HF causal LM, with any cache, and ``hf-nosa eval``.

Methods (``--cache``): ``default`` (transformers' DynamicCache: full attention), ``nosa`` (NosaCache with the NOSA
rule), and the training-free baselines of ``hf_nosa.baselines`` on the same NosaCache engine and budget
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

from ..baselines import BASELINES, make_selector
from ..cache import NosaCache
from ..config import NosaConfig
from ..modeling import eviction_heads, to_nosa
from .decode import decode
from .perplexity import long_generation_perplexity, perplexity_documents
from .tasks import DEFAULT_TASKS, TASKS, TokenCounter, generate_samples

METHODS = ("default", "nosa", *BASELINES)


# ----- models -----


def load_model(path: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A causal LM and its tokenizer from a local folder; a config with a "nosa" section loads as a NOSA model.

    NOSA checkpoints (``model_type`` llama/qwen2/qwen3 or nosa_llama/nosa_qwen2/nosa_qwen3, with a "nosa" section)
    are rebuilt as the stock family class converted by ``to_nosa`` and loaded strictly, eviction heads included.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; --model must be a folder saved with save_pretrained")
    raw = json.loads(config_file.read_text())
    if "nosa" in raw:
        model = _load_nosa_checkpoint(path, raw)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if (path / "tokenizer.json").is_file():
        # Straight from tokenizer.json: AutoTokenizer would read config.json, whose remote code it must not run.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _load_nosa_checkpoint(path: Path, raw: dict):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    family = str(raw.get("model_type", "")).removeprefix("nosa_")
    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: model_type={raw.get('model_type')!r} is not a NOSA family (llama, qwen2, qwen3)")
    skip = ("auto_map", "architectures", "model_type", "nosa", "transformers_version")
    config = AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k not in skip})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    to_nosa(model, NosaConfig.from_dict(raw["nosa"]))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = {}
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing")
        state.update(load_file(str(path / name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path}: weights do not match the model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model


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
                   batch_size: int = 8, prefill_chunk: int = 4096, progress=None) -> dict:
    """Accuracy per task at one length with one method: ``{"tasks": {task: acc}, "mean_accuracy", ...}``."""
    with _attention_for(model, method):
        return _evaluate_tasks(model, tokenizer, tasks, length, method, nosa_config, samples, seed, batch_size,
                               prefill_chunk, progress)


def _attention_for(model, method: str):
    return dense_attention_outside_nosa_cache(model) if method == "default" else contextlib.nullcontext()


def _evaluate_tasks(model, tokenizer, tasks, length, method, nosa_config, samples, seed, batch_size, prefill_chunk,
                    progress) -> dict:
    make_cache = cache_factory(model, method, nosa_config)
    counter = TokenCounter(tokenizer)
    stop_ids = _stop_ids(tokenizer)
    all_samples = [s for task in tasks for s in generate_samples(task, n=samples, length=length, tokenizer=tokenizer, seed=seed)]
    scores: dict[str, list[float]] = {task: [] for task in tasks}
    examples: dict[str, dict] = {}
    traffic = _Traffic()
    steps = 0
    for lo in range(0, len(all_samples), batch_size):
        batch = all_samples[lo : lo + batch_size]
        encoded = [tokenizer(s.prompt, add_special_tokens=True)["input_ids"] for s in batch]
        T = max(len(ids) for ids in encoded)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (T - len(ids)) + ids for ids in encoded])
        attention_mask = torch.tensor([[0] * (T - len(ids)) + [1] * len(ids) for ids in encoded])
        suffix = max(counter.count(s.question) for s in batch) + 1
        max_new = max(counter.count(s.target) for s in batch) + 2
        cache = make_cache()
        result = decode(model, input_ids, attention_mask=attention_mask, cache=cache, decode_from=max(1, T - suffix),
                        max_new_tokens=max_new, stop_ids=stop_ids, prefill_chunk=prefill_chunk)
        traffic.add(cache, result, len(batch))
        steps += result.decode_steps
        for sample, row in zip(batch, result.tokens.tolist()):
            prediction = tokenizer.decode(row, skip_special_tokens=True)
            scores[sample.task].append(sample.score(prediction))
            examples.setdefault(sample.task, {"prediction": prediction.split("\n")[0], "answers": list(sample.answers)})
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
    show_progress: bool = True,
    verbose: bool = True,
    on_result=None,
) -> list[dict]:
    """Every (length, method) pair: task accuracy, long-generation perplexity, locality and traffic.

    Args:
        budget_tokens: the NosaCache budget for every length; else ``length / budget_ratio`` (rounded down to
            whole blocks; ratio 8 when neither is given).
        layout: sink_tokens / local_tokens / query_tokens overrides for ``nosa_layout``.
        verbose: print one line per result.
        on_result: called with each result dict as soon as it is ready (to save partial results).

    Returns:
        One dict per (length, method).
    """
    tasks, methods = list(tasks), list(methods)
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
    section = getattr(model.config, "nosa", None)  # None: never trained with NOSA (converted here, A = 0)
    if section is not None and not eviction_heads(model):
        raise ValueError("the model config has a 'nosa' section but the model has no eviction heads; load it with load_model")
    if any(m != "default" for m in methods) and section is None:
        first = budget_for(None, lengths[0], budget_tokens, budget_ratio)
        to_nosa(model, nosa_layout(None, first, **(layout or {})))
    progress = _progress(show_progress, total=len(lengths) * len(methods) * len(tasks) * samples)
    results = []
    for length in lengths:
        docs = perplexity_documents(tokenizer, length=length, n=perplexity_docs, seed=seed) if perplexity_docs else []
        for method in methods:
            started = time.perf_counter()
            budget, nosa_config = None, None
            if method != "default":
                budget = budget_for(section, length, budget_tokens, budget_ratio)
                nosa_config = nosa_layout(section, budget, **(layout or {}))
            if progress is not None:
                progress.set_description(f"{length} {method}")
            row = {"length": length, "method": method, "budget_tokens": budget,
                   "nosa_config": nosa_config.to_dict() if nosa_config else None}
            row.update(evaluate_tasks(model, tokenizer, tasks=tasks, length=length, method=method, nosa_config=nosa_config,
                                      samples=samples, seed=seed, batch_size=batch_size, prefill_chunk=prefill_chunk,
                                      progress=progress))
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
            if on_result is not None:
                on_result(row)
            if verbose:
                if progress is not None:
                    progress.write(format_row(row))
                else:
                    print(format_row(row), flush=True)
    if progress is not None:
        progress.close()
    return results


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="folder of a causal LM saved with save_pretrained (NOSA or not)")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help=f"tasks (comma or space separated) from {', '.join(TASKS)}")
    parser.add_argument("--lengths", nargs="+", default=["4096", "8192", "16384"], help="prompt lengths in tokens")
    parser.add_argument("--cache", nargs="+", default=list(METHODS), help=f"methods from {', '.join(METHODS)}")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=int, help="NosaCache budget in tokens at every length")
    budget.add_argument("--budget-ratio", type=int, help="budget = length / RATIO (default 8)")
    parser.add_argument("--sink-tokens", type=int)
    parser.add_argument("--local-tokens", type=int)
    parser.add_argument("--query-tokens", type=int)
    parser.add_argument("--samples", type=int, default=4, help="samples per task and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ppl-docs", type=int, default=4, help="standard-library documents for perplexity (0: skip)")
    parser.add_argument("--ppl-tokens", type=int, default=128, help="tokens decoded and scored per document")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when present)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    tasks = _split_list(args.tasks)
    methods = _split_list(args.cache)
    try:
        lengths = [int(x) for x in _split_list(args.lengths)]
    except ValueError:
        raise ValueError(f"--lengths must be integers, got {args.lengths}") from None
    for name, value in (("--samples", args.samples), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid: it must be at least 1")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    model, tokenizer = load_model(args.model, device=device, dtype=getattr(torch, dtype_name))
    layout = {k: v for k, v in (("sink_tokens", args.sink_tokens), ("local_tokens", args.local_tokens),
                                ("query_tokens", args.query_tokens)) if v is not None}
    budget_ratio = None if args.budget is not None else (args.budget_ratio or 8)
    out = Path(args.out) if args.out else None
    report = {"environment": environment(), "model": str(args.model), "dtype": dtype_name, "results": []}

    def save(row):
        report["results"].append(row)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2))

    evaluate(model, tokenizer, tasks=tasks, lengths=lengths, methods=methods, budget_tokens=args.budget,
             budget_ratio=budget_ratio, samples=args.samples, seed=args.seed, batch_size=args.batch_size,
             perplexity_docs=args.ppl_docs, perplexity_tokens=args.ppl_tokens, layout=layout,
             show_progress=not args.no_progress, on_result=save)
    if out is not None:
        print(f"results written to {out}")
    return 0
