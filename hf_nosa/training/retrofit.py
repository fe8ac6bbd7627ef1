"""Retrofit a stock Llama / Qwen2 / Qwen3 checkpoint into a NOSA model: LoRA plus fully trained eviction heads.

The model trains with the attention it will decode with (``attention/training.py``): ``to_nosa`` adds the eviction
heads, PEFT adds LoRA to the projections named by the recipe, and the eviction heads train in full through
``modules_to_save`` (design Sec. 5); with the recipe's ``distill_loss`` each micro-step also distils from the base
model (``training/distill.py``). Runs single-process or under ``accelerate launch`` (DDP; FSDP through
accelerate's own sharded checkpoints).

The output directory holds the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``, eviction
heads included) and ``nosa_retrofit.json``; ``checkpoints/step-N/`` hold what ``resume=True`` continues from (the
trainable weights, optimizer, scheduler, RNG states, loss history).

Example:
    >>> result = retrofit("tiny", "data.jsonl", "out/tiny")  # doctest: +SKIP
    >>> model = merge_adapter("out/tiny")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..attention.selection_loss import enable_selection_loss, selection_loss
from ..config import NosaConfig
from ..modeling import FAMILIES, eviction_heads, family_of, to_nosa
from .allocator import allocator_setting, use_expandable_segments
from .data import BUILTIN_DATA, DATA_SUFFIXES, data_files, pack_data  # noqa: F401  (part of this module's API)
from .distill import distill_kl, teacher_logits
from .recipe import DEFAULTS, LORA_KEYS, REQUIRED, load_recipe  # noqa: F401  (part of this module's API)

logger = logging.getLogger(__name__)

RUN_FILE = "nosa_retrofit.json"
TRAINER_STATE = "trainer_state.json"
TRAINABLE_FILE = "trainable.safetensors"
RECIPE_MODEL = "recipe:model"  # base_model of a run whose base was built from the recipe's model config

TIME_LIMIT_RESERVE_S = 20.0  # a time-limited run leaves this much for writing the checkpoint, adapter and tokenizer
TIME_PLAN_STEPS = 3  # steps timed after the first (which compiles) before a time-limited run plans its length


# ----- models -----


def load_base(spec: str | dict | nn.Module, *, dtype: torch.dtype | str | None = None) -> nn.Module:
    """The stock base model of a recipe: a Hub id, a local folder, a ``.gguf`` file or ``smollm2`` (loaded as a plain
    model: see ``hf_nosa.modeling.loading``), a ``{"config": ...}`` mapping, or a module as is.

    A mapping builds a random model of its ``family`` from ``config``, seeded by ``seed`` (the global RNG is left
    untouched), so that tests and synthetic experiments need no download.
    """
    if isinstance(spec, nn.Module):
        return spec
    if isinstance(spec, dict):
        binding = FAMILIES[spec["family"]]
        config = binding.MODEL_CLASS.config_class(**spec["config"])
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.get("seed", 0))
            model = binding.MODEL_CLASS(config)
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model
    from ..modeling.loading import load_pretrained

    return load_pretrained(spec, dtype=dtype or "auto")


def _batch(packed: torch.Tensor, step: int, micro: int, recipe: dict, rank: int, world: int, orders: dict):
    """The micro-batch of one process: a fixed function of (step, micro, rank), so a resumed run sees the same data.

    Epoch e visits the sequences in a permutation seeded by (seed, e); ``orders`` caches the permutations.
    """
    n, bs = packed.shape[0], recipe["batch_size"]
    first = ((step * recipe["grad_accum"] + micro) * world + rank) * bs
    rows = []
    for g in range(first, first + bs):
        epoch = g // n
        if epoch not in orders:
            orders.clear()
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(recipe["seed"] * 100003 + epoch))
        rows.append(int(orders[epoch][g % n]))
    return packed[rows]


def _schedule(recipe: dict, plan: dict | None = None):
    """Linear warmup, then a cosine from 1 down to 0.1 at the last step: ``plan["steps"]`` when given (a
    time-limited run sets it once it knows how many steps fit), else the recipe's ``steps``."""
    warmup = recipe["warmup_steps"]

    def factor(step: int) -> float:
        steps = plan["steps"] if plan is not None else recipe["steps"]
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def lora_config(recipe: dict):
    """The PEFT ``LoraConfig`` of a recipe: its LoRA settings, with the eviction heads trained in full."""
    from peft import LoraConfig

    lora = recipe["lora"]
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=list(lora["target_modules"]), modules_to_save=["eviction_head"],
                      task_type="CAUSAL_LM")


# ----- checkpoints -----


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _checkpoints(output_dir: Path) -> list[Path]:
    root = output_dir / "checkpoints"
    found = [p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _register_checkpoint_hooks(accelerator, model) -> None:
    """Checkpoints keep only the trainable weights (LoRA + eviction heads), not the frozen base.

    accelerate hands the hooks the full state dicts to save and the models to load; taking them out of its lists
    makes it skip them. Under FSDP both lists are empty (accelerate saves the sharded model itself).
    """
    from safetensors.torch import load_file, save_file

    def save_hook(models, weights, output_dir):
        if not weights:
            return
        weights.clear()
        if accelerator.is_main_process:
            state = {k: v.detach().cpu().contiguous() for k, v in _trainable(accelerator.unwrap_model(model)).items()}
            save_file(state, str(Path(output_dir) / TRAINABLE_FILE))

    def load_hook(models, input_dir):
        if not models:
            return
        models.clear()
        params = _trainable(accelerator.unwrap_model(model))
        state = load_file(str(Path(input_dir) / TRAINABLE_FILE))
        if set(state) != set(params):
            raise RuntimeError(f"checkpoint {input_dir} does not match this model's trainable weights: missing "
                               f"{sorted(set(params) - set(state))[:5]}, unexpected {sorted(set(state) - set(params))[:5]}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def _save_checkpoint(accelerator, output_dir: Path, step: int, history: dict, keep: int) -> None:
    path = output_dir / "checkpoints" / f"step-{step:07d}"
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / TRAINER_STATE).write_text(json.dumps({**history, "step": step}, indent=1))
        for old in _checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


# ----- the run -----


class _TimeLimit:
    """Ends a run in time: plans its length from the first timed steps, then stops early if steps slow down.

    ``elapsed()`` counts from the call of ``retrofit`` (loading and tokenizing included), agreed on by every process.
    The first step compiles, so the rate is the mean of the later ones; until ``TIME_PLAN_STEPS`` of those are
    timed the first step's own time is the estimate.
    """

    def __init__(self, limit: float, started: float, accelerator):
        self.limit, self.started, self.accelerator = limit, started, accelerator
        self.first_end = None
        self.timed = 0

    def elapsed(self) -> float:
        value = time.perf_counter() - self.started
        if self.accelerator.num_processes > 1:  # every process must take the same decision
            value = float(self.accelerator.reduce(torch.tensor([value], device=self.accelerator.device), "max"))
        return value

    def after_step(self, done: int, stop: int) -> tuple[int, bool]:
        """``(stop, planned)`` after global step ``done``: the step to end at, and whether it was planned just now."""
        now = self.elapsed()
        if self.first_end is None:
            self.first_end, per_step = now, now
        else:
            self.timed += 1
            per_step = (now - self.first_end) / self.timed
        left = self.limit - TIME_LIMIT_RESERVE_S - now
        if self.timed == TIME_PLAN_STEPS:
            return min(stop, done + max(0, math.floor(left / per_step))), True
        return (done if per_step > left else stop), False


@dataclass
class RetrofitResult:
    """What ``retrofit`` returns: the trained PEFT model (eval mode) and the numbers of the run."""

    model: nn.Module
    output_dir: Path
    steps: int
    final_loss: float
    tokens_per_second: float
    losses: list[float] = field(default_factory=list)


def _device_memory_check(recipe: dict, device: torch.device) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        if total < recipe["device_memory_gb"]:
            logger.warning("the recipe needs about %.0f GB of device memory; this device has %.0f GB",
                           recipe["device_memory_gb"], total)


def _build_model(recipe: dict, base, dtype: torch.dtype):
    """Base -> to_nosa -> gradient checkpointing -> PEFT LoRA with the eviction heads trained in full (fp32)."""
    from peft import get_peft_model

    model = load_base(base, dtype=dtype)
    family = family_of(model)
    cfg = NosaConfig.from_dict(recipe["nosa"])
    to_nosa(model, cfg)
    for head in eviction_heads(model).values():
        head.float()  # trained from scratch: fp32 masters beside a bf16 base
    if recipe["gradient_checkpointing"]:
        if hasattr(model, "activation_checkpointing_enable"):  # the transformers >= 5.2x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, lora_config(recipe))
        if recipe["selection_loss"] or recipe["eviction_loss"]:
            enable_selection_loss(model, recipe["selection_loss"], eviction_weight=recipe["eviction_loss"])
    return model, family, cfg


def _optimizer(model: nn.Module, recipe: dict) -> torch.optim.Optimizer:
    """AdamW with two learning rates: the eviction heads (trained from zero) and LoRA."""
    groups = {"eviction": [], "lora": []}
    for name, param in _trainable(model).items():
        groups["eviction" if ".eviction_head." in name else "lora"].append(param)
    return torch.optim.AdamW(
        [{"params": groups["eviction"], "lr": recipe["lr_eviction"]}, {"params": groups["lora"], "lr": recipe["lr_lora"]}],
        weight_decay=recipe["weight_decay"],
    )


def retrofit(recipe, data=None, output_dir=None, *, base_model=None, resume: bool = False, max_steps: int | None = None,
             time_limit: float | None = None):
    """Retrofit a base model into NOSA with LoRA and trained eviction heads; write the adapter and the run JSON.

    Args:
        recipe: a recipe dict, a YAML path, or a bare name of ``recipes/`` (see ``load_recipe``).
        data: a .jsonl/.json/.parquet/.txt file or a folder of them (``input_ids`` or text records), or a built-in
            corpus (``BUILTIN_DATA``); default the recipe's ``data``.
        output_dir: where the adapter, ``nosa_retrofit.json`` and ``checkpoints/`` go.
        base_model: overrides the recipe's model: a local folder, a Hub id, or a loaded ``nn.Module``.
        resume: continue from the latest checkpoint in ``output_dir`` (same step count, data order, RNG state).
        max_steps: stop after this global step (a checkpoint is written there), e.g. to split a run in parts.
        time_limit: seconds from this call within which the run must end (a wall-clock budget). Once the first
            ``TIME_PLAN_STEPS`` steps after the first are timed, the run plans how many steps fit, leaving
            ``TIME_LIMIT_RESERVE_S`` to save, and its learning-rate schedule ends there (recorded as
            ``schedule_steps`` in ``nosa_retrofit.json`` and the checkpoint, which ``resume`` keeps); if steps slow
            down it stops sooner. A checkpoint and the adapter are written either way.

    Returns:
        ``RetrofitResult`` (model, steps, final_loss, tokens_per_second, losses of every step so far).
    """
    from accelerate import Accelerator
    from accelerate.utils import parse_flag_from_env, set_seed
    from tqdm.auto import tqdm

    import hf_nosa

    called = time.perf_counter()
    recipe = load_recipe(recipe)
    base = base_model if base_model is not None else recipe["model"]
    if isinstance(base, str):
        recipe["model"] = base
    elif base_model is not None and not isinstance(base_model, nn.Module):
        raise TypeError(f"base_model must be a folder, a Hub id or an nn.Module, got {type(base_model).__name__}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps={max_steps!r} is invalid: a positive integer or None")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not time_limit > TIME_LIMIT_RESERVE_S):
        raise ValueError(f"time_limit={time_limit!r} is invalid: seconds, more than the {TIME_LIMIT_RESERVE_S:.0f} s "
                         "kept for saving, or None")
    if output_dir is None:
        raise ValueError("output_dir is required (--output): the folder the adapter is written to")
    output_dir = Path(output_dir)
    data = data if data is not None else recipe["data"]
    if data is None:
        raise ValueError(f"no training data: pass data= (--data) or set the recipe's data (a path, or one of "
                         f"{BUILTIN_DATA})")
    data_files(data)
    found = _checkpoints(output_dir)
    if resume and not found:
        raise ValueError(f"resume=True but {output_dir} holds no checkpoint (checkpoints/step-N)")
    if found and not resume:
        raise ValueError(f"{output_dir} already holds checkpoints; pass resume=True or choose an empty output dir")
    # Per step: the LM loss, the alignment losses (with eviction_loss / selection_loss), the KL to the base model
    # (with distill_loss, unweighted) and the gradient norm before clipping: what a run that diverges is read from.
    history = {"losses": [], "aux_losses": [], "distill_losses": [], "grad_norms": [], "tokens": 0, "recipe": recipe}
    if found:
        saved = json.loads((found[-1] / TRAINER_STATE).read_text())
        before = {**DEFAULTS, **saved["recipe"]}  # a key added since the checkpoint was written has its default
        if before != recipe:
            changed = sorted(k for k in {*recipe, *before} if recipe.get(k) != before.get(k))
            raise ValueError(f"resume: the recipe differs from the checkpoint's in {changed}; use the same recipe")

    # bf16 on GPU; CPU trains in fp32. `accelerate launch --cpu` (or ACCELERATE_USE_CPU) forces the CPU.
    cuda = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    accelerator = Accelerator(mixed_precision="bf16" if cuda else "no", step_scheduler_with_optimizer=False)
    _device_memory_check(recipe, accelerator.device)
    use_expandable_segments(accelerator.device)  # long sequences otherwise strand memory between the step's tensors
    if isinstance(base, nn.Module):
        eos_id = base.config.eos_token_id
    elif isinstance(base, dict):
        eos_id = base["config"].get("eos_token_id")
    else:
        from ..modeling.loading import load_config

        eos_id = load_config(base).eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    with accelerator.main_process_first():  # a built-in corpus is tokenized as far as the whole run reads
        packed = pack_data(data, recipe, base, eos_id, sequences=recipe["steps"] * recipe["grad_accum"]
                           * recipe["batch_size"] * accelerator.num_processes)

    set_seed(recipe["seed"])
    model, family, cfg = _build_model(recipe, base, torch.bfloat16 if cuda else torch.float32)
    optimizer = _optimizer(model, recipe)
    plan = {"steps": recipe["steps"]}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(recipe, plan))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    _register_checkpoint_hooks(accelerator, model)
    start = 0
    if found:
        accelerator.load_state(str(found[-1]))
        saved = json.loads((found[-1] / TRAINER_STATE).read_text())
        start, history = saved["step"], {**history, "losses": saved["losses"], "tokens": saved["tokens"],
                                         "aux_losses": saved.get("aux_losses", []),
                                         "distill_losses": saved.get("distill_losses", []),
                                         "grad_norms": saved.get("grad_norms", [])}
        if "schedule_steps" in saved:  # a time-limited run's schedule goes on where it ended
            plan["steps"] = history["schedule_steps"] = saved["schedule_steps"]
        if saved.get("world_size", accelerator.num_processes) != accelerator.num_processes:
            logger.warning("resuming with %d processes a run that had %d: the data order changes",
                           accelerator.num_processes, saved["world_size"])
    history["world_size"] = accelerator.num_processes

    stop = min(recipe["steps"], max_steps or recipe["steps"])
    timer = _TimeLimit(float(time_limit), called, accelerator) if time_limit is not None else None
    rank, world = accelerator.process_index, accelerator.num_processes
    step_tokens = recipe["batch_size"] * recipe["seq_len"] * recipe["grad_accum"] * world
    bar = tqdm(total=recipe["steps"], initial=start, disable=not accelerator.is_main_process, desc="retrofit")
    model.train()
    unwrapped = accelerator.unwrap_model(model)
    began, run_tokens, orders = time.perf_counter(), 0, {}
    for step in range(start, stop):
        total = torch.zeros((), device=accelerator.device)
        total_aux = total_kl = None
        for micro in range(recipe["grad_accum"]):
            ids = _batch(packed, step, micro, recipe, rank, world, orders).to(accelerator.device)
            sync = micro == recipe["grad_accum"] - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                # the base model's logits (no LoRA, stock attention, no gradient), before the student's graph exists
                teacher = teacher_logits(model, unwrapped, ids) if recipe["distill_loss"] else None
                out = model(input_ids=ids, labels=ids, use_cache=False)
                objective = loss = out.loss
                aux = selection_loss(model)  # None unless the recipe weights an alignment loss
                if aux is not None:
                    objective = objective + aux
                kl = distill_kl(out.logits, teacher) if teacher is not None else None
                if kl is not None:
                    objective = objective + recipe["distill_loss"] * kl
                del out, teacher  # only what the backward saved of the logits stays alive
                accelerator.backward(objective / recipe["grad_accum"])
            total += loss.detach().float()
            if aux is not None:
                total_aux = aux.detach().float() + (0 if total_aux is None else total_aux)
            if kl is not None:
                total_kl = kl.detach().float() + (0 if total_kl is None else total_kl)
        if recipe["max_grad_norm"] is not None:
            norm = accelerator.clip_grad_norm_(model.parameters(), recipe["max_grad_norm"])
            history["grad_norms"].append(float(norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = float(accelerator.reduce(total / recipe["grad_accum"], "mean"))
        history["losses"].append(step_loss)
        if total_aux is not None:
            history["aux_losses"].append(float(accelerator.reduce(total_aux / recipe["grad_accum"], "mean")))
        if total_kl is not None:
            history["distill_losses"].append(float(accelerator.reduce(total_kl / recipe["grad_accum"], "mean")))
        history["tokens"] += step_tokens
        run_tokens += step_tokens
        speed = run_tokens / (time.perf_counter() - began)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{speed:,.0f}")
        done = step + 1
        if timer is not None:
            stop, planned = timer.after_step(done, stop)
            if planned:
                plan["steps"] = history["schedule_steps"] = stop
                if accelerator.is_main_process:
                    bar.write(f"retrofit: time limit {time_limit:.0f}s, {time.perf_counter() - called:.0f}s used: the run (and its "
                              f"learning-rate schedule) ends at step {stop}")
        if (recipe["save_every"] and done % recipe["save_every"] == 0) or (done == stop and stop < recipe["steps"]):
            _save_checkpoint(accelerator, output_dir, done, history, recipe["keep_checkpoints"])
        if done >= stop:
            break
    bar.close()
    elapsed = time.perf_counter() - began
    speed = run_tokens / elapsed if run_tokens else 0.0

    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)
    peft_model = accelerator.unwrap_model(model)
    steps_done = max(start, stop)
    final_loss = history["losses"][-1] if history["losses"] else float("nan")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        peft_model.save_pretrained(str(output_dir), state_dict=state)
        if isinstance(base, nn.Module):
            base_name = getattr(base.config, "_name_or_path", "") or ""
        else:
            base_name = base if isinstance(base, str) else RECIPE_MODEL
        run = dict(base_model=base_name, family=family, nosa_config=cfg.to_dict(), recipe=recipe, steps=steps_done,
                   final_loss=final_loss, tokens_per_second=speed, hf_nosa_version=hf_nosa.__version__,
                   allocator=allocator_setting() if cuda else None)
        if time_limit is not None:
            run.update(time_limit_s=float(time_limit), schedule_steps=plan["steps"],
                       seconds=time.perf_counter() - called)
        (output_dir / RUN_FILE).write_text(json.dumps(run, indent=1))
        # every step's loss of the whole run (a resumed one included), beside the adapter: what reports plot
        (output_dir / TRAINER_STATE).write_text(json.dumps({**history, "step": steps_done}, indent=1))
        from ..modeling.loading import is_gguf, load_tokenizer

        if is_gguf(base_name):  # its tokenizer lives in the GGUF file: keep a copy beside the adapter (export uses it)
            load_tokenizer(base_name).save_pretrained(str(output_dir))
    accelerator.wait_for_everyone()
    peft_model.eval()
    return RetrofitResult(peft_model, output_dir, steps_done, final_loss, speed, list(history["losses"]))


# ----- adapters -----


def read_run(adapter_dir: str | Path) -> dict:
    """The ``nosa_retrofit.json`` of an adapter directory."""
    path = Path(adapter_dir) / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a NOSA retrofit adapter: {RUN_FILE} is missing")
    return json.loads(path.read_text())


def load_adapter(model_or_base, adapter_dir: str | Path):
    """A PeftModel: the adapter (LoRA + eviction heads) of ``adapter_dir`` on a NOSA model.

    Args:
        model_or_base: a model converted with ``to_nosa`` under the adapter's NosaConfig, or a base given as a
            folder / Hub id (loaded and converted here).

    Raises:
        ValueError: the model has no eviction heads, its family or NosaConfig differs from the adapter's, or an
            eviction head of the adapter did not land in the model. Weights are never dropped silently.
        MissingExtraError: peft, a dependency of hf-nosa, is not installed.
    """
    try:
        from peft import PeftModel
    except ModuleNotFoundError:
        from ..modeling.loading import MissingExtraError

        raise MissingExtraError('loading a retrofit adapter needs peft, a dependency of hf-nosa that is not installed: '
                                'pip install "peft>=0.17" (or reinstall hf-nosa)') from None
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    run = read_run(adapter_dir)
    expected = NosaConfig.from_dict(run["nosa_config"])
    if isinstance(model_or_base, (str, Path)):
        model = to_nosa(load_base(str(model_or_base)), expected)
    elif isinstance(model_or_base, nn.Module):
        model = model_or_base
    else:
        raise TypeError(f"model_or_base must be an nn.Module, a folder or a Hub id, got {type(model_or_base).__name__}")
    family = family_of(model)
    if family != run["family"]:
        raise ValueError(f"the adapter was trained on a {run['family']} model; this model is {family}")
    heads, layers = eviction_heads(model), len(model.model.layers)
    if len(heads) != layers:
        raise ValueError(f"the model has eviction heads in {len(heads)} of its {layers} layers; the adapter trains one "
                         "per layer. Convert it first: to_nosa(model, NosaConfig.from_dict(read_run(dir)['nosa_config']))")
    actual = NosaConfig.from_model_config(model.config)
    if actual != expected:
        diff = {k: (v, expected.to_dict()[k]) for k, v in actual.to_dict().items() if v != expected.to_dict()[k]}
        raise ValueError(f"the model's NosaConfig differs from the adapter's in {diff} (model, adapter); convert with "
                         "to_nosa(model, <the adapter's config>) first, change inference settings after loading")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    stored = load_file(str(adapter_dir / "adapter_model.safetensors"))
    stored_heads = {k for k in stored if ".eviction_head." in k}
    if len({k.split(".eviction_head.")[0] for k in stored_heads}) != layers:
        raise ValueError(f"{adapter_dir} holds eviction heads for fewer than the model's {layers} layers")
    params = dict(peft_model.named_parameters())
    for key in stored_heads:
        name = key.replace(".eviction_head.", ".eviction_head.modules_to_save.default.")
        if name not in params or not torch.equal(params[name].detach().cpu(), stored[key].to(params[name].dtype)):
            raise ValueError(f"the adapter's {key} did not load into the model")
    return peft_model.eval()


def merge_adapter(adapter_dir: str | Path, base_model=None) -> nn.Module:
    """The NOSA model with the adapter merged in (``merge_and_unload``): eviction heads kept, in the model's dtype.

    Args:
        base_model: a stock base (folder, Hub id or module) or an already converted one; default the run's
            ``base_model`` (or the recipe's model config for a base built from one).
    """
    run = read_run(adapter_dir)
    if base_model is None:
        base_model = run["base_model"]
        if base_model == RECIPE_MODEL:
            base_model = run["recipe"]["model"]
        if not base_model:
            raise ValueError(f"the run in {adapter_dir} records no base model name: pass base_model")
    model = load_base(base_model)
    if not eviction_heads(model):
        model = to_nosa(model, NosaConfig.from_dict(run["nosa_config"]))
    merged = load_adapter(model, adapter_dir).merge_and_unload()
    dtype = merged.model.layers[0].self_attn.v_proj.weight.dtype
    for head in eviction_heads(merged).values():
        head.to(dtype)
    return merged.eval()


# ----- the command (``hf-nosa retrofit``; its arguments are in ``hf_nosa.cli.args``; under several processes
# ``accelerate launch -m hf_nosa.cli retrofit ...``) -----


def run(args) -> int:
    result = retrofit(args.recipe, args.data, args.output, base_model=args.base_model, resume=args.resume,
                      max_steps=args.max_steps, time_limit=getattr(args, "time_limit", None))
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"retrofit: {result.steps} steps, final loss {result.final_loss:.4f}, "
              f"{result.tokens_per_second:,.0f} tokens/s; adapter in {result.output_dir}")
    return 0
