"""The quality experiment, end to end in one time-boxed run: pretrain, retrofit, control, evaluate, export.

    PYTHONPATH=. python experiments/quality/run.py --out DIR              # one GPU, ~13 minutes in all
    PYTHONPATH=. python experiments/quality/run.py --out DIR --smoke      # the whole pipeline on CPU, ~2 minutes
    PYTHONPATH=. python experiments/quality/run.py --out DIR --preset cpu-demo   # the CPU-trained demo model

Stages (each bounded by the wall clock; results.json is rewritten after every stage and every evaluation row):

1. pretrain a tiny Llama-architecture model (GQA, byte tokenizer) with full attention on a mix of the synthetic
   tasks and standard-library text (train split) at the preset's short lengths;
2. retrofit it with NOSA at the long length: ``to_nosa`` + PEFT LoRA + fully trained eviction heads, trained with
   the NOSA training attention (the model's own forward in training mode, ``prefill="nosa"``);
3. control: the same LoRA fine-tune, same steps and data, with full attention;
4. evaluate at the long length and twice it, at context/budget = 8: full attention (control, default cache), NOSA
   retrofit, NOSA untrained (control with ``A = 0``) and the training-free baselines (control) on the same engine;
5. export the retrofitted model as a NOSA checkpoint (``hf_nosa.hub.export``) into DIR/demo_model, with plots
   and a results.md table.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data import PackedStream, loader  # noqa: E402
from train import train  # noqa: E402

import hf_nosa  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.eval import TASKS, evaluate  # noqa: E402
from hf_nosa.eval.corpus import corpus_text  # noqa: E402
from hf_nosa.eval.runner import budget_for, environment, format_row, nosa_layout  # noqa: E402
from hf_nosa.hub import export  # noqa: E402
from hf_nosa.attention.selection_loss import enable_selection_loss, selection_loss  # noqa: E402
from hf_nosa.modeling.tokenizer import VOCAB_SIZE, build_tokenizer  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

PRESETS = {
    # One H200, ~13 minutes in all.
    "gpu": dict(
        model=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64),
        train_tasks=list(TASKS),
        # Task lengths uniform, not log-uniform: needles must sit at every distance for retrieval to be learned.
        task_share=0.7, answer_weight=4.0, min_task_len=384, task_lengths="uniform",
        # (sequence length, batch, share of the pretraining time). Retrieval forms at short lengths first (an
        # induction-style phase change after a few hundred steps in CPU probes) and does not carry over to twice
        # the trained length, so each phase doubles the length and re-adapts it.
        pretrain=dict(phases=[(512, 64, 0.15), (1024, 32, 0.15), (2048, 16, 0.3), (4096, 8, 0.4)], share=0.40, lr=3e-3),
        # GPU round 3's best at 8K (docs/results.md, run N): 4-token windows, 256 query-aware tokens, selection loss
        # 0.03. NOSA 0.865 against 0.922 for full attention and 0.710 for Quest, but locality 0.90 (64 query-aware
        # tokens keep it at ~0.96 and score 0.38-0.43) and collapsed at 16K (0.09; without the selection loss 0.39).
        # Windows: 2/1 let training-free selection see every needle; 16/8 average byte-level number needles away
        # (round 2: the retrofit learned to answer without them).
        nosa=dict(block_size=64, budget_tokens=1024, sink_tokens=64, local_tokens=256, query_tokens=256,
                  compress_kernel=4, compress_stride=2),
        # eviction_loss: weight of hf_nosa.attention.selection_loss.eviction_alignment_loss, summed over layers. Without it
        # every A stayed within 0.06 of 0 in 1,200 steps (round 2, run A); with 0.1 it reached 0.6-1.1; 0.3 scored
        # lower (round 3, run G). selection_loss: its query-aware counterpart. 0.03-0.1 raised NOSA at 8K in all four
        # round-3 pairs (0.45 -> 0.56 at q128, 0.53 -> 0.82-0.87 at q256) and broke 16K in all four; 0.5 wrecked the
        # model (runs J, L: 0.01-0.10 with full attention too). --eviction-loss W, --selection-loss W.
        retrofit=dict(seq_len=8192, batch=4, share=0.20, lr=2e-3, head_lr=3e-2, rank=32, alpha=64,
                      selection_loss=0.03, eviction_loss=0.1, selection_positions=32),
        # YaRN x4 over the 4K pretraining length in the long fine-tunes (retrofit and control): without it every model
        # scored ~0 at 16K; with it full attention scores 0.57 there and 0.92 at 8K (round 2, run D). --rope-factor.
        rope_factor=4.0,
        control=dict(share=0.08),
        # one batch per row at 8K (all 72 samples), two at 16K: dense prefill logits stay under ~40 GB
        eval=dict(lengths=[8192, 16384], budget_ratio=8, samples=8, batch={4096: 72, 8192: 72, 16384: 36}, ppl_docs=8,
                  ppl_tokens=128, share=0.30, tasks=list(TASKS), extras=True),
        workers=6,
        minutes=13.0,
    ),
    # The whole pipeline on CPU at toy sizes (checks every code path; the numbers mean nothing).
    "smoke": dict(
        model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32),
        train_tasks=list(TASKS),
        task_share=0.6, answer_weight=4.0, min_task_len=320,
        pretrain=dict(phases=[(512, 4, 0.5), (768, 2, 0.5)], share=0.2, lr=3e-3),
        nosa=dict(block_size=16, budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16,
                  compress_kernel=8, compress_stride=4),
        retrofit=dict(seq_len=512, batch=2, share=0.12, lr=2e-3, head_lr=1e-2, rank=8, alpha=16),
        control=dict(share=0.08),
        eval=dict(lengths=[384, 768], budget_ratio=8, samples=1, batch={384: 2, 768: 2}, ppl_docs=1,
                  ppl_tokens=8, share=0.55, tasks=["passkey", "niah_single_number"], extras=False),
        workers=0,
        minutes=1.6,
    ),
    # The demo model shipped in hf_nosa/assets before the GPU-trained one replaced it: passkey retrieval, trained on
    # CPU (two cores, ~25 minutes).
    "cpu-demo": dict(
        model=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32),
        train_tasks=["passkey"],
        task_share=1.0, answer_weight=5.0, min_task_len=96, task_lengths="uniform",
        pretrain=dict(phases=[(256, 32, 0.65), (512, 16, 0.35)], share=0.5, lr=3e-3),
        # Windows of 2 bytes: a needle is a few byte tokens, and wider windows average it away (with kernel 8 the
        # pass-key block ranked 5th-32nd among the query-aware candidates of the retrieval layer; with 2/1, 1st-3rd).
        nosa=dict(block_size=16, budget_tokens=128, sink_tokens=16, local_tokens=32, query_tokens=64,
                  compress_kernel=2, compress_stride=1),
        retrofit=dict(seq_len=1024, batch=8, share=0.25, lr=1e-3, head_lr=3e-2, rank=16, alpha=32,
                      selection_loss=0.0, selection_positions=32),
        control=dict(share=0.12),
        eval=dict(lengths=[1024, 2048], budget_ratio=8, samples=16, batch={512: 16, 1024: 16, 2048: 16}, ppl_docs=2,
                  ppl_tokens=32, share=0.13, tasks=["passkey"], extras=False),
        workers=0,
        minutes=25.0,
    ),
}


class Run:
    """The run's output folder: log, progressively rewritten results.json."""

    def __init__(self, out: Path, preset: str, settings: dict, minutes: float):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "log.txt", "a")
        self.started = time.perf_counter()
        self.budget = minutes * 60
        self.results = {"environment": environment(), "preset": preset, "minutes": minutes, "settings": settings,
                        "stages": {}, "evaluation": [], "notes": []}
        self.save()

    def log(self, message: str) -> None:
        line = f"[{time.perf_counter() - self.started:7.1f}s] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def seconds(self, share: float) -> float:
        return share * self.budget

    def save(self) -> None:
        self.results["elapsed_seconds"] = time.perf_counter() - getattr(self, "started", time.perf_counter())
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.out / "results.json")

    def stage(self, name: str, info: dict) -> None:
        self.results["stages"][name] = info
        self.save()


def build_model(settings: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    longest = max(settings["eval"]["lengths"]) * 2
    config = LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=longest, rope_theta=500000.0,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, **settings["model"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class PhasedBatches:
    """Batches from one stream per phase; the phase changes with the share of ``seconds`` elapsed."""

    def __init__(self, settings: dict, phases, seconds: float, seed: int, workers: int):
        self.settings, self.phases, self.seconds, self.seed, self.workers = settings, phases, seconds, seed, workers
        self.started = time.perf_counter()
        self.index, self.iterator = -1, None

    def _stream(self, seq_len: int, batch: int):
        s = self.settings
        stream = PackedStream(seq_len, tasks=s["train_tasks"], task_share=s["task_share"],
                              min_task_len=min(s["min_task_len"], seq_len // 2), answer_weight=s["answer_weight"],
                              seed=self.seed, lengths=s.get("task_lengths", "loguniform"))
        return iter(loader(stream, batch, self.workers))

    def __iter__(self):
        return self

    def __next__(self):
        elapsed = (time.perf_counter() - self.started) / self.seconds
        bound, index = 0.0, len(self.phases) - 1
        for i, (_, _, share) in enumerate(self.phases):
            bound += share
            if elapsed < bound:
                index = i
                break
        if index != self.index:
            self.iterator = None  # stops the previous phase's workers
            seq_len, batch, _ = self.phases[index]
            self.iterator = self._stream(seq_len, batch)
            self.index = index
        return next(self.iterator)


def lora_model(model, settings: dict, *, with_heads: bool):
    from peft import LoraConfig, get_peft_model

    r = settings["retrofit"]
    config = LoraConfig(r=r["rank"], lora_alpha=r["alpha"], lora_dropout=0.0, target_modules=LORA_TARGETS,
                        modules_to_save=["eviction_head"] if with_heads else None)
    peft_model = get_peft_model(model, config)
    lora = [p for n, p in peft_model.named_parameters() if p.requires_grad and "eviction_head" not in n]
    heads = [p for n, p in peft_model.named_parameters() if p.requires_grad and "eviction_head" in n]
    groups = [{"params": lora, "lr": r["lr"]}]
    if heads:
        groups.append({"params": heads, "lr": r["head_lr"]})
    return peft_model, groups


def stretch_rope(model, factor: float, *, original: int) -> None:
    """YaRN RoPE scaling by ``factor`` over the ``original`` pretraining length, for the long fine-tunes.

    The base never saw positions past ``original``; YaRN keeps the high-frequency dimensions (local order) and
    interpolates the slow ones, so that twice the fine-tuning length still maps into angles pretraining saw.
    """
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = model.config
    theta = config.rope_parameters["rope_theta"]
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                              "original_max_position_embeddings": original}
    config.max_position_embeddings = int(original * factor)  # what transformers checks the factor against
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(next(model.parameters()).device)


def use_training_backend(backend: str) -> str:
    """Pin the NOSA training attention's backend for this process ("auto" leaves hf_nosa's choice)."""
    import hf_nosa.modeling.attention as attention_module

    if backend == "auto" or not hasattr(attention_module, "nosa_training_attention"):
        return backend
    original = getattr(attention_module.nosa_training_attention, "func", attention_module.nosa_training_attention)
    attention_module.nosa_training_attention = functools.partial(original, backend=backend)
    return backend


def fine_tune(run: Run, name: str, base, settings, *, nosa: NosaConfig | None, seconds: float, max_steps, device,
              seed: int, workers: int):
    """LoRA (+ eviction heads when ``nosa``) fine-tune of a copy of ``base`` at the long length; merged result."""
    model = copy.deepcopy(base)
    if settings.get("rope_factor"):
        stretch_rope(model, settings["rope_factor"], original=settings["pretrain"]["phases"][-1][0])
    if nosa is not None:
        to_nosa(model, nosa)
    peft_model, groups = lora_model(model, settings, with_heads=nosa is not None)
    extra_loss = None
    r = settings["retrofit"]
    weight, eviction_weight = r.get("selection_loss", 0.0), r.get("eviction_loss", 0.0)
    if nosa is not None and (weight or eviction_weight):
        enable_selection_loss(peft_model, weight, positions=r.get("selection_positions", 32), eviction_weight=eviction_weight)
        extra_loss = functools.partial(selection_loss, peft_model)
    batches = PhasedBatches(settings, [(r["seq_len"], r["batch"], 1.0)], seconds, seed + 1, workers)
    run.log(f"{name}: {sum(p.numel() for g in groups for p in g['params']) / 1e3:.0f}K trainable parameters, "
            f"seq {r['seq_len']} x batch {r['batch']}, up to {seconds:.0f}s" + (f" / {max_steps} steps" if max_steps else ""))
    info = train(peft_model, batches, param_groups=groups, seconds=seconds, max_steps=max_steps, device=device,
                 log=run.log, log_every=10, extra_loss=extra_loss)
    info["selection_loss_weight"] = weight if nosa is not None else 0.0
    info["eviction_loss_weight"] = eviction_weight if nosa is not None else 0.0
    merged = peft_model.merge_and_unload()
    merged.eval()
    if nosa is not None:
        a = torch.cat([layer.self_attn.eviction_head.A.detach().float().flatten() for layer in merged.model.layers])
        info["eviction_A"] = a.tolist()
    return merged, info


def eval_rows(run: Run, settings, models: dict, tokenizer, device, deadline: float, layout: NosaConfig) -> None:
    """Every length: full attention + training-free methods on the control, NOSA on the retrofit, then extras."""
    e = settings["eval"]
    # First, cheap and diagnostic: does the pretrained base retrieve at the length it was trained at? (Retrieval
    # learned at one length did not carry over to twice that length in CPU probes, so the long-length rows need
    # the fine-tunes to re-adapt it.)
    plan = [("base", settings["pretrain"]["phases"][-1][0], ["default"])]
    for length in e["lengths"]:
        plan += [("control", length, ["default"]), ("retrofit", length, ["nosa"]),
                 ("control", length, ["query_only", "quest", "shadowkv", "nosa"])]
    for length in e["lengths"] if e["extras"] else []:  # sanity rows: the retrofit and the base, full attention
        plan += [("retrofit", length, ["default"]), ("base", length, ["default"])]
    labels = {("control", "default"): "full_attention", ("control", "nosa"): "nosa_untrained",
              ("retrofit", "nosa"): "nosa", ("retrofit", "default"): "nosa_retrofit_full_attention",
              ("base", "default"): "base_full_attention"}
    for source, length, methods in plan:
        for method in methods:
            label = labels.get((source, method), method)
            if time.perf_counter() > deadline:
                run.results["notes"].append(f"evaluation of {label} at {length} skipped: time box reached")
                run.log(f"skip {label} at {length}: time box reached")
                continue
            model = models[source]

            def keep(row, label=label, source=source):
                row.update(label=label, model=source)
                run.results["evaluation"].append(row)
                run.save()
                run.log(format_row(row, label=label))

            try:
                evaluate(model, tokenizer, tasks=e["tasks"], lengths=[length], methods=[method],
                         budget_ratio=e["budget_ratio"], samples=e["samples"], seed=0,
                         batch_size=e["batch"].get(length, 8), perplexity_docs=e["ppl_docs"],
                         perplexity_tokens=e["ppl_tokens"], prefill_chunk=length, show_progress=False,
                         verbose=False, on_result=keep)  # one prefill call: no materialised mask
            except Exception as error:  # one failed row must not lose the others
                run.results["notes"].append(f"evaluation of {label} at {length} failed: {error!r}")
                run.log(f"FAILED {label} at {length}: {error!r}\n{traceback.format_exc()}")
                run.save()


def summarize(run: Run, settings) -> dict:
    rows = run.results["evaluation"]
    summary = {}
    for length in settings["eval"]["lengths"]:
        at = {row["label"]: row for row in rows if row["length"] == length}
        if not at:
            continue
        entry = {label: {"mean_accuracy": row["mean_accuracy"], "perplexity": row.get("perplexity"),
                         "locality": row.get("locality"), "bytes_to_device_per_token": row.get("bytes_to_device_per_token"),
                         "budget_tokens": row.get("budget_tokens")} for label, row in at.items()}
        full, nosa = at.get("full_attention"), at.get("nosa")
        baselines = [at[k] for k in ("query_only", "quest", "shadowkv", "nosa_untrained") if k in at]
        targets = {}
        if full and nosa:
            ratio = nosa["mean_accuracy"] / full["mean_accuracy"] if full["mean_accuracy"] > 0 else float("nan")
            targets["nosa_over_full_accuracy"] = ratio
            targets["nosa_at_least_95pct_of_full"] = bool(ratio >= 0.95)
            if full.get("perplexity") and nosa.get("perplexity"):
                targets["nosa_perplexity_over_full"] = nosa["perplexity"] / full["perplexity"]
                targets["nosa_perplexity_within_5pct"] = bool(nosa["perplexity"] <= 1.05 * full["perplexity"])
        if nosa and baselines:
            margin = nosa["mean_accuracy"] - max(b["mean_accuracy"] for b in baselines)
            targets["nosa_minus_best_training_free_points"] = 100 * margin
            targets["nosa_10_points_above_training_free"] = bool(margin >= 0.10)
        if nosa and nosa.get("locality") is not None:
            targets["nosa_locality_at_least_0.94"] = bool(nosa["locality"] >= 0.94)
        entry["targets"] = targets
        summary[str(length)] = entry
    run.results["summary"] = summary
    run.save()
    return summary


def write_recipe(run: Run, settings: dict, layout: NosaConfig, steps: int) -> None:
    """DIR/retrofit_recipe.yaml: the retrofit stage as a recipe for ``hf-nosa retrofit`` (base model: DIR/base).

    The stage runs its own time-boxed loop (so that the control can repeat it exactly, with the same weighted
    task data); the recipe has its ingredients: NosaConfig, LoRA on every projection, eviction heads trained in
    full, the two learning rates, sequence length, batch and the steps the stage took.
    """
    r = settings["retrofit"]
    recipe = {
        "model": "base",
        "tokenizer": "bytes",
        "nosa": layout.to_dict(),
        "lora": {"r": r["rank"], "alpha": r["alpha"], "dropout": 0.0, "target_modules": LORA_TARGETS},
        "seq_len": r["seq_len"],
        "lr_eviction": r["head_lr"],
        "lr_lora": r["lr"],
        "steps": max(1, steps),
        "warmup_steps": max(1, steps // 20),
        "batch_size": r["batch"],
        "grad_accum": 1,
        "device_memory_gb": 40,
    }
    if r.get("selection_loss") or r.get("eviction_loss"):
        recipe.update(selection_loss=r.get("selection_loss", 0.0), eviction_loss=r.get("eviction_loss", 0.0),
                      gradient_checkpointing=False)
    try:
        from hf_nosa.training.retrofit import load_recipe

        load_recipe(recipe)
        checked = True
    except ImportError:
        checked = False
    except Exception as error:  # recorded, not fatal: the experiment does not depend on it
        run.results["notes"].append(f"retrofit_recipe.yaml does not validate: {error!r}")
        checked = False
    (run.out / "retrofit_recipe.yaml").write_text(json.dumps(recipe, indent=2) + "\n")  # JSON is YAML
    run.results["stages"]["retrofit"]["recipe_validated"] = checked
    run.save()


def export_demo(run: Run, model, tokenizer, settings, out: Path, passkey_accuracy) -> None:
    """The retrofitted model as a NOSA checkpoint (bf16 safetensors) in ``out``, with demo.json."""
    model = copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16)
    e = settings["eval"]
    to_nosa(model, NosaConfig.from_dict(settings["nosa"], prefill="nosa"))  # the checkpoint states its training rule
    export(model, out, tokenizer=tokenizer, overwrite=True, repo_id="hf-nosa/demo-tiny-llama", license="apache-2.0")
    demo = {
        "context_tokens": e["lengths"][0],
        "budget_tokens": e["lengths"][0] // e["budget_ratio"],
        "task": "passkey",
        "trained_on": settings["train_tasks"],
        "passkey_accuracy": passkey_accuracy,
        "note": "tiny model trained by experiments/quality/run.py; see docs/results.md",
    }
    (out / "demo.json").write_text(json.dumps(demo, indent=2))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    run.stage("export", {"folder": out.name, "bytes": size, "demo": demo})
    run.log(f"exported the retrofitted model to {out} ({size / 1e6:.1f} MB)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--smoke", action="store_true", help="same as --preset smoke (CPU, toy sizes)")
    parser.add_argument("--minutes", type=float, help="total wall-clock budget (default: the preset's)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="cap pretraining and the retrofit at this many steps each (with a large --minutes, the "
                             "run's work no longer depends on the machine's speed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--training-backend", default="auto", choices=("auto", "flex", "explicit"),
                        help="NOSA training attention backend for the retrofit (auto: hf_nosa's choice)")
    parser.add_argument("--workers", type=int, help="data-loading processes (default: the preset's)")
    parser.add_argument("--base", help="start from this saved base model (a run's DIR/base) instead of pretraining")
    parser.add_argument("--pretrain-only", action="store_true",
                        help="stop after pretraining (DIR/base, for later runs with --base)")
    parser.add_argument("--eviction-loss", type=float, help="weight of the eviction alignment loss in the retrofit "
                        "(default: the preset's; 0 turns it off)")
    parser.add_argument("--query-tokens", type=int, help="query-aware share of the budget in tokens (default: the preset's)")
    parser.add_argument("--rope-factor", type=float, help="YaRN RoPE scaling of the long fine-tunes (retrofit and control) "
                        "by this factor over the pretraining length; 1 turns it off (default: the preset's)")
    parser.add_argument("--windows", help="compression windows as KERNEL/STRIDE, e.g. 16/8 (default: the preset's)")
    parser.add_argument("--selection-loss", type=float, help="weight of the selection alignment loss in the retrofit "
                        "(default: the preset's; 0 turns it off)")
    args = parser.parse_args(argv)
    preset = "smoke" if args.smoke else args.preset
    settings = copy.deepcopy(PRESETS[preset])
    minutes = args.minutes or settings["minutes"]
    if args.selection_loss is not None:
        settings["retrofit"]["selection_loss"] = args.selection_loss
    for flag, value in (("--selection-loss", args.selection_loss), ("--eviction-loss", args.eviction_loss)):
        if value is not None and value < 0:
            parser.error(f"{flag}={value} is invalid: it must be >= 0 (0 turns the loss off)")
    if args.eviction_loss is not None:
        settings["retrofit"]["eviction_loss"] = args.eviction_loss
    if args.query_tokens is not None:
        settings["nosa"]["query_tokens"] = args.query_tokens
    if args.rope_factor is not None:
        if args.rope_factor < 1:
            parser.error(f"--rope-factor={args.rope_factor} is invalid: it must be at least 1 (1: no scaling)")
        settings["rope_factor"] = args.rope_factor if args.rope_factor > 1 else None
    if args.windows is not None:
        kernel, _, stride = args.windows.partition("/")
        if not (kernel.isdigit() and stride.isdigit()):
            parser.error(f"--windows={args.windows!r} is invalid: give KERNEL/STRIDE in tokens, e.g. 16/8")
        settings["nosa"].update(compress_kernel=int(kernel), compress_stride=int(stride))
    NosaConfig(**settings["nosa"])  # a bad layout fails here, naming the field, before any work
    for length in settings["eval"]["lengths"]:  # and so does one the evaluation's smaller budgets cannot hold
        budget = budget_for(settings["nosa"], length, None, settings["eval"]["budget_ratio"])
        try:
            nosa_layout(settings["nosa"], budget)
        except ValueError as error:
            parser.error(f"the evaluation at {length} tokens has a budget of {budget} tokens, too small for this layout: {error}")
    workers = settings["workers"] if args.workers is None else args.workers
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    run = Run(out, preset, settings, minutes)
    run.log(f"preset {preset} on {device} ({run.results['environment']['device']}), {minutes} minutes, hf_nosa {hf_nosa.__version__}")
    tokenizer = build_tokenizer()
    layout = NosaConfig(prefill="nosa", **settings["nosa"])
    corpus_text("train")  # read once here, so that data-loading processes share it

    # 1. pretrain with full attention (or start from a given base)
    if args.base:
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM.from_pretrained(args.base, attn_implementation="sdpa").to(device)
        previous = Path(args.base).parent / "results.json"
        info = json.loads(previous.read_text())["stages"]["pretrain"] if previous.is_file() else {}
        info = {**info, "given_base": True}
        run.log(f"pretrain: skipped, starting from the given base ({info.get('steps', '?')} pretraining steps)")
    else:
        base = build_model(settings, args.seed).to(device)
        p = settings["pretrain"]
        seconds = run.seconds(p["share"])
        run.log(f"pretrain: {sum(x.numel() for x in base.parameters()) / 1e6:.2f}M parameters, phases {p['phases']}, {seconds:.0f}s")
        info = train(base, PhasedBatches(settings, p["phases"], seconds, args.seed, workers),
                     param_groups=[{"params": list(base.parameters()), "lr": p["lr"]}], seconds=seconds, device=device,
                     max_steps=args.max_steps, log=run.log)
    info["parameters"] = sum(x.numel() for x in base.parameters())
    run.stage("pretrain", info)
    base.save_pretrained(out / "base")
    if args.pretrain_only:
        run.results["finished"] = True
        run.save()
        run.log(f"pretrain only: base saved to {out / 'base'}")
        return 0

    # 2. NOSA retrofit (LoRA + eviction heads, NOSA training attention)
    backend = use_training_backend(args.training_backend)
    seconds = run.seconds(settings["retrofit"]["share"])
    try:
        retrofit, info = fine_tune(run, "retrofit", base, settings, nosa=layout, seconds=seconds, max_steps=args.max_steps,
                                   device=device, seed=args.seed, workers=workers)
    except Exception as error:
        if args.training_backend != "auto" or device.type != "cuda":
            raise
        run.log(f"retrofit with the default training backend failed ({error!r}); retrying with backend='explicit'")
        run.results["notes"].append(f"training backend auto failed: {error!r}; used explicit")
        backend = use_training_backend("explicit")
        retrofit, info = fine_tune(run, "retrofit", base, settings, nosa=layout, seconds=seconds, max_steps=args.max_steps,
                                   device=device, seed=args.seed, workers=workers)
    info["training_backend"] = backend
    info["nosa_config"] = layout.to_dict()
    run.stage("retrofit", info)
    retrofit.save_pretrained(out / "retrofit")
    write_recipe(run, settings, layout, info["steps"])

    # 3. control: the same fine-tune with full attention, same number of steps
    control, info = fine_tune(run, "control", base, settings, nosa=None, seconds=run.seconds(settings["control"]["share"]),
                              max_steps=max(1, run.results["stages"]["retrofit"]["steps"]), device=device,
                              seed=args.seed, workers=workers)
    run.stage("control", info)
    control.save_pretrained(out / "control")

    # 4. evaluate (bf16 on GPU); the control gets eviction heads with A = 0 for the NosaCache methods
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for model in (control, retrofit):  # eval-time layout: every NosaCache method prefills densely (runner.py)
        to_nosa(model, layout.replace(prefill="dense"))
    models = {name: m.to(dtype=dtype).eval() for name, m in (("control", control), ("retrofit", retrofit), ("base", base))}
    deadline = run.started + run.budget - (20 if preset == "gpu" else 5)
    run.log(f"evaluate until {deadline - run.started:.0f}s: lengths {settings['eval']['lengths']}")
    eval_rows(run, settings, models, tokenizer, device, deadline, layout)
    summary = summarize(run, settings)
    run.log("summary: " + json.dumps({k: {m: v["mean_accuracy"] for m, v in s.items() if m != "targets"} for k, s in summary.items()}))

    # 5. export, plots, table
    first = settings["eval"]["lengths"][0]
    nosa_rows = [r for r in run.results["evaluation"] if r["label"] == "nosa" and r["length"] == first]
    passkey = nosa_rows[0]["tasks"].get("passkey") if nosa_rows else None
    try:
        from report import write_report

        write_report(out)
    except Exception as error:  # the results are already on disk
        run.log(f"report failed: {error!r}\n{traceback.format_exc()}")
    export_demo(run, retrofit, tokenizer, settings, out / "demo_model", passkey)
    run.results["finished"] = True
    run.save()
    run.log(f"done in {time.perf_counter() - run.started:.0f}s; results in {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
