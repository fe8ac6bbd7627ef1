"""Tensor parallelism for NOSA models: transformers' ``tp_plan`` shards the model, each rank holds its own KV heads.

transformers shards a Llama / Qwen2 / Qwen3 model by its config's ``base_model_tp_plan``: q_proj, k_proj and v_proj
column-wise, so rank r of N computes query heads ``[r H/N, (r+1) H/N)`` and KV heads ``[r Hk/N, (r+1) Hk/N)`` (each
GQA group stays on one rank), and o_proj row-wise (partial outputs summed by one all-reduce). NOSA's attention reads
every shape from its tensors (``view(..., -1, D)``), so a rank's attention sees ``H/N`` query and ``Hk/N`` KV heads,
and a NosaCache layer sizes itself from the key states it receives: each rank's host store, compressed keys and slot
pool hold its own KV heads only, on its own device, where the fetch and decode kernels run. ``NosaConfig`` is the same
on every rank, so every rank selects with the same budget, per KV head, as the unsharded model does.

The eviction head is the one place that mixes KV heads: ``delta`` (Linear ``Hk*D -> Hk``) reads the values of all
of them, and a rank holds only its own (v_proj is column-sharded). Since
``delta(v)[h] = sum_r W[h, cols_r] . v_r + bias[h]``, each rank multiplies its values by its heads' columns of
``W`` (a partial ``[B, T, Hk]`` in float32), one all-reduce sums the partials, the bias is added once, and the rank
keeps its own heads' rows and ``A[lo:hi]``: one all-reduce of ``B * T * Hk`` float32 per layer and forward (a decode
step at Hk = 8 and batch 32: 1 KiB per layer), beside the two transformers adds (o_proj, down_proj). All-gathering the
values instead would move ``D`` times as many bytes (128x at D = 128) and compute all of ``delta`` on every rank.

The eviction head's parameters stay whole on every rank (``Hk * (Hk*D + 2)`` numbers per layer: 8.2K in an 8B shape,
16 KiB bf16): checkpoints save and load them unchanged (transformers shards only what its plan names; the plan does
not name them), and a rank slices its columns and rows where it computes. ``shard_eviction_heads`` makes them
identical on every rank (rank 0's) once, when the model is converted or loaded, so a freshly converted model's
random ``delta`` cannot differ between ranks.

Inference only: gradients through a sharded eviction head are not synchronised across ranks (training under tensor
parallelism is not supported).

Example (``torchrun --nproc-per-node 2 script.py``; docs/tensor_parallel.md):
    >>> model = AutoModelForCausalLM.from_pretrained(repo, tp_plan="auto", trust_remote_code=True)  # doctest: +SKIP
    >>> out = model.generate(**inputs, cache_implementation="nosa")  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..rules.selection import eviction_scores


class KVHeadShard:
    """This rank's KV heads ``[lo, hi)`` of one layer under tensor parallelism, and the process group over which the
    layer's KV heads are split. Called by ``EvictionHead.forward`` in place of the unsharded rule."""

    def __init__(self, group, rank: int, size: int, lo: int, hi: int, head_dim: int):
        self.group, self.rank, self.size = group, rank, size
        self.lo, self.hi, self.head_dim = lo, hi, head_dim

    def __repr__(self) -> str:
        return f"KVHeadShard(rank={self.rank} of {self.size}, kv_heads=[{self.lo}, {self.hi}))"

    def __call__(self, head: nn.Module, value_flat: torch.Tensor) -> torch.Tensor:
        """``[B, T, Hk_local * D]`` this rank's values -> ``[B, Hk_local, T]`` float32 eviction scores of its heads."""
        weight, bias = head.delta.weight, head.delta.bias
        D = self.head_dim
        if value_flat.shape[-1] != (self.hi - self.lo) * D:
            raise ValueError(
                f"eviction head: rank {self.rank} holds KV heads [{self.lo}, {self.hi}) ({(self.hi - self.lo) * D} "
                f"value features), but its values are {tuple(value_flat.shape)}"
            )
        columns = weight[:, self.lo * D:self.hi * D]
        partial = F.linear(value_flat.float(), columns.float())  # [B, T, Hk]: this rank's share of delta(v)
        if partial.requires_grad:
            import torch.distributed.nn.functional as dist_fn

            partial = dist_fn.all_reduce(partial, group=self.group)
        else:
            torch.distributed.all_reduce(partial, group=self.group)
        if bias is not None:
            partial = partial + bias.float()
        # the unsharded head's delta output is in the weight's dtype: round there, as it does
        logits = partial.to(weight.dtype)[..., self.lo:self.hi]
        A = head.A[self.lo:self.hi]
        if (torch.is_grad_enabled() and (logits.requires_grad or A.requires_grad)) or torch.compiler.is_compiling():
            return eviction_scores(logits, A)
        from ..kernels.layers.eviction_bias import eviction_scale

        return eviction_scale(logits, A)


def kv_head_shard(attn: nn.Module) -> KVHeadShard | None:
    """The KV heads a rank holds of one attention layer, read from how its v_proj weight is sharded (a DTensor with
    ``Shard(0)``, as transformers' "colwise" leaves it); None when the layer holds every KV head."""
    from torch.distributed.tensor import DTensor, Shard

    weight = attn.v_proj.weight
    kv_heads, D = attn.eviction_head.A.shape[0], attn.head_dim
    if not isinstance(weight, DTensor):
        return None  # every KV head (values narrowed some other way fail in the eviction head's forward, by name)
    mesh_dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim in (0, -2)]
    if not mesh_dims:
        return None  # replicated on every rank
    if len(mesh_dims) > 1:
        raise ValueError(f"layer {attn.layer_idx}: v_proj is sharded over several mesh dimensions "
                         f"{weight.placements}; NOSA supports one tensor-parallel dimension.")
    mesh, i = weight.device_mesh, mesh_dims[0]
    size, rank = mesh.size(i), mesh.get_local_rank(i)
    if size == 1:
        return None
    if kv_heads % size:
        raise ValueError(
            f"layer {attn.layer_idx}: {kv_heads} KV heads cannot be split over {size} tensor-parallel ranks; NOSA "
            f"keeps each KV head's host store and slot pool on one rank, so num_key_value_heads must be a multiple of "
            f"the tensor-parallel size (use {', '.join(str(n) for n in range(1, kv_heads + 1) if kv_heads % n == 0)} "
            "processes)."
        )
    local = kv_heads // size
    if weight.to_local().shape[0] != local * D:
        raise ValueError(f"layer {attn.layer_idx}: rank {rank} holds {weight.to_local().shape[0]} rows of v_proj, not "
                         f"its {local} KV heads x {D}")
    return KVHeadShard(mesh.get_group(i), rank, size, rank * local, (rank + 1) * local, D)


@torch.no_grad()
def shard_eviction_heads(model: nn.Module) -> int:
    """Give every eviction head of a model sharded by transformers' tensor parallelism its rank's KV heads (or none
    on an unsharded model), and make the heads' parameters identical on every rank (rank 0's: one broadcast per
    parameter, once). Called by ``to_nosa`` and by NOSA checkpoints' ``from_pretrained``; every rank must call it.
    Returns the number of sharded layers."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0  # no process group, no DTensor: nothing is sharded
    sharded = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        head = getattr(attn, "eviction_head", None)
        if head is None or attn.v_proj.weight.device.type == "meta":
            continue
        shard = kv_head_shard(attn)
        head.tensor_parallel = shard
        if shard is None:
            continue
        sharded += 1
        source = torch.distributed.get_global_rank(shard.group, 0)
        for param in (head.delta.weight, head.delta.bias, head.A):
            if param is not None:
                torch.distributed.broadcast(param.data, src=source, group=shard.group)
    return sharded
