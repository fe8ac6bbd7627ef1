"""Where one retrofit step's device memory goes, layer by layer: dense sdpa against NOSA training attention.

The step of ``benchmarks/train_step.py`` (same model shapes, LoRA recipe, gradient checkpointing, bf16 autocast),
run after one warm-up step (``--steps``), with hooks on every decoder layer's attention and MLP (a decoder layer's
own hooks stay outside its checkpoint and miss the backward's rerun). Each event (a layer's attention starting or
ending, its MLP ending, in the first forward or in the backward's rerun; the loss; the end of the backward) records
the memory allocated then and the peak since the previous event, so the timeline shows which stretch of the step
sets the peak and how NOSA's differs from dense's. A mode that does not fit is recorded with the allocator's message
and the frames it failed in, beside the events that ran before. The allocator runs as ``retrofit`` runs it (expandable
segments, ``hf_nosa/training/allocator.py``) unless ``PYTORCH_ALLOC_CONF`` says otherwise; each event records the memory
reserved and the part of it stranded inside segments that also hold live tensors (``inactive_split_gb``).

    python -m benchmarks train memory --shape 8b --length 65536 --out docs/results
    python -m benchmarks train memory --smoke        # tiny sizes on the CPU (no memory numbers)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.train_step import SHAPE_SMOKE, SHAPES, SMOKE_NOSA, _reset_peak, build  # noqa: E402
from hf_nosa import NosaConfig  # noqa: E402
from hf_nosa.training.allocator import allocator_setting, use_expandable_segments  # noqa: E402
from hf_nosa.attention.held_forward import in_backward  # noqa: E402
from hf_nosa.training.retrofit import load_recipe  # noqa: E402

GB = 2**30


class Timeline:
    """Memory at each event and the peak since the previous one (CUDA; on the CPU only the events)."""

    def __init__(self, device):
        self.device, self.events = device, []

    def mark(self, event: str, layer: int | None = None) -> None:
        row = dict(event=event, layer=layer, backward=in_backward())
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats()
            # reserved but not allocated, and the part of it inside segments that also hold live tensors: what
            # fragmentation strands (a wholly free segment goes back to the driver before an allocation fails)
            row.update(allocated_gb=torch.cuda.memory_allocated() / GB,
                       reserved_gb=stats.get("reserved_bytes.all.current", 0) / GB,
                       inactive_split_gb=stats.get("inactive_split_bytes.all.current", 0) / GB,
                       peak_since_last_gb=torch.cuda.max_memory_allocated() / GB,
                       reserved_peak_since_last_gb=torch.cuda.max_memory_reserved() / GB)
            torch.cuda.reset_peak_memory_stats()
        self.events.append(row)

    def summary(self) -> dict:
        rows = [e for e in self.events if "peak_since_last_gb" in e]
        if not rows:
            return {}
        top = max(range(len(rows)), key=lambda i: rows[i]["peak_since_last_gb"])
        # the peak falls in the stretch from the event before ``top`` to ``top``
        loss = next((e for e in rows if e["event"] == "loss"), {})
        return dict(peak_gb=rows[top]["peak_since_last_gb"], inactive_split_at_loss_gb=loss.get("inactive_split_gb"),
                    max_inactive_split_gb=max(e["inactive_split_gb"] for e in rows),
                    reserved_peak_gb=max(e["reserved_peak_since_last_gb"] for e in rows),
                    peak_from=rows[top - 1] if top else None, peak_to=rows[top],
                    first_forward_peak_gb=max((e["peak_since_last_gb"] for e in rows if not e["backward"]), default=0),
                    backward_peak_gb=max((e["peak_since_last_gb"] for e in rows if e["backward"]), default=0))


def _layers(model):
    return model.get_base_model().model.layers


def measure(mode: str, shape: dict, cfg: NosaConfig, recipe: dict, seq_len: int, device, dtype, steps: int) -> dict:
    _reset_peak(device)
    model, optimizer = build(mode, shape, cfg, recipe, device, dtype)
    timeline = Timeline(device)
    handles = []
    for i, layer in enumerate(_layers(model)):
        handles.append(layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: timeline.mark("attention_start", i)))
        handles.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: timeline.mark("attention_end", i)))
        handles.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: timeline.mark("mlp_end", i)))
    ids = torch.randint(3, shape["vocab_size"], (1, seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    row, loss = dict(mode=mode, seq_len=seq_len), None
    try:
        for step in range(steps):  # the first tunes the kernels; only the last step's events are kept
            timeline.events.clear()
            _reset_peak(device)
            timeline.mark("step_start")
            with autocast:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            timeline.mark("loss")
            loss.backward()
            timeline.mark("backward_end")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timeline.mark("optimizer_end")
        row.update(timeline.summary(), events=timeline.events)
    except torch.OutOfMemoryError as error:
        frames = [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"
                  for f in traceback.extract_tb(error.__traceback__)]
        ours = [f for f in frames if "hf_nosa" in f or "benchmarks" in f]
        row.update(oom=True, message=str(error).split("\n")[0][:400], frames=(ours[-6:] + frames[-3:]),
                   events=timeline.events[-12:], step=step)
    finally:
        for h in handles:
            h.remove()
        del model, optimizer, loss  # a step that failed in its backward leaves its graph on the loss
        _reset_peak(device)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES), help="model shape (default 1b)")
    parser.add_argument("--length", type=int, default=65536, help="sequence length (default 65536)")
    parser.add_argument("--modes", default="dense,nosa", help="comma-separated among dense, nosa")
    parser.add_argument("--steps", type=int, default=2,
                        help="steps run; the last one's events are recorded (1: the step that tunes the kernels)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--out", default=None, help="folder for train_memory_<shape>_<length>[_<tag>].json")
    parser.add_argument("--tag", default="", help="suffix of the file name (e.g. the allocator setting tried)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if args.steps < 1:
        parser.error(f"--steps {args.steps} is invalid: it must be at least 1")
    if any(m not in ("dense", "nosa") for m in modes):
        parser.error(f"--modes {args.modes!r} is not supported; allowed values are dense, nosa")
    shape, recipe_name = SHAPES[args.shape]
    recipe = load_recipe(recipe_name)
    cfg = NosaConfig.from_dict(recipe["nosa"])
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype, seq_len = torch.bfloat16, args.length
    if args.smoke:
        shape, cfg, dtype, seq_len = SHAPE_SMOKE, NosaConfig(**SMOKE_NOSA), torch.float32, 256
    elif device.type != "cuda":
        parser.error("the full benchmark needs a GPU; use --smoke on the CPU")
    use_expandable_segments(device)  # as retrofit runs; PYTORCH_ALLOC_CONF=expandable_segments:False for the default
    report = dict(environment(), shape=args.shape if not args.smoke else "smoke", allocator=allocator_setting(),
                  results=[])
    for mode in modes:
        row = measure(mode, shape, cfg, recipe, seq_len, device, dtype, args.steps)
        report["results"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "events"})[:1500], flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"train_memory_{report['shape']}_{seq_len}{'_' + args.tag if args.tag else ''}.json"
        path = os.path.join(args.out, name)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
