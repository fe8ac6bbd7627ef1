"""The selection alignment loss: its value against a per-position reference, its gradient, and the plumbing."""

import pytest
import torch

from hf_nosa import to_nosa
from hf_nosa.selection import compress_keys, query_block_scores
from hf_nosa.selection_loss import enable_selection_loss, sampled_positions, selection_alignment_loss, selection_loss

from .conftest import small_nosa_config, tiny_model


def _reference(query, key, cfg, scale, positions):
    """One position at a time, no shared tensors: dense block mass vs query-aware score over the chosen-among blocks."""
    B, H, T, D = query.shape
    Hk = key.shape[1]
    G, P = H // Hk, cfg.block_size
    N = -(-T // P)
    ck = compress_keys(key.float(), cfg)
    kls = []
    for t in sampled_positions(T, cfg, positions).tolist():
        current = t // P
        among = [n for n in range(cfg.sink_blocks, current - cfg.local_blocks)]
        score = query_block_scores(query[:, :, t : t + 1].float(), ck, torch.tensor([t]), N, cfg, scale)[:, :, 0]
        for b in range(B):
            for h in range(Hk):
                mass = torch.zeros(N)
                for g in range(G):
                    logits = query[b, h * G + g, t].float() @ key[b, h, : t + 1].float().T * scale
                    p = torch.softmax(logits, -1)
                    for n in range(N):
                        mass[n] += p[n * P : (n + 1) * P].sum()
                target = mass[among] / mass[among].sum()
                predicted = score[b, h, among] / score[b, h, among].sum()
                kls.append((target * (target.log() - predicted.clamp_min(1e-8).log())).sum())
    return torch.stack(kls).mean()


@pytest.mark.parametrize("group", [1, 2, 4])
def test_loss_equals_per_position_reference(group):
    cfg = small_nosa_config()
    torch.manual_seed(group)
    B, Hk, T, D = 2, 2, 200, 16
    q, k = torch.randn(B, Hk * group, T, D), torch.randn(B, Hk, T, D)
    loss = selection_alignment_loss(q, k, cfg, D**-0.5, positions=7)
    torch.testing.assert_close(loss, _reference(q, k, cfg, D**-0.5, 7), atol=1e-5, rtol=1e-4)
    assert loss > 0


def test_gradient_reaches_queries_and_keys_and_training_lowers_the_loss():
    cfg = small_nosa_config()
    torch.manual_seed(0)
    # peaked attention (large logits) that the mean-pooled windows blur: a clear mismatch to start from
    q = (2 * torch.randn(1, 4, 256, 16)).requires_grad_()
    k = (2 * torch.randn(1, 2, 256, 16)).requires_grad_()
    first = selection_alignment_loss(q, k, cfg, 0.25, positions=16)
    first.backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0
    optimizer = torch.optim.Adam([q, k], lr=3e-2)
    for _ in range(60):
        optimizer.zero_grad()
        loss = selection_alignment_loss(q, k, cfg, 0.25, positions=16)
        loss.backward()
        optimizer.step()
    assert first.item() > 0.1 and loss.item() < 0.5 * first.item()


def test_short_sequences_have_no_candidate_blocks():
    cfg = small_nosa_config()  # sink 1 + local 2 blocks of 16: a first choice at token 64
    assert sampled_positions(64, cfg, 8).numel() == 0
    loss = selection_alignment_loss(torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), cfg, 0.25)
    assert loss.item() == 0.0


def test_model_plumbing_leaves_outputs_unchanged_and_trains_projections():
    cfg = small_nosa_config()
    model = to_nosa(tiny_model("llama"), cfg).train()
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(0))
    plain = model(input_ids=ids).logits
    assert selection_loss(model) is None  # off by default
    enable_selection_loss(model, 0.5, positions=8)
    logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, plain)  # an extra objective, not a different attention
    aux = selection_loss(model)
    assert aux is not None and aux > 0
    assert selection_loss(model) is None  # collected once
    aux.backward()
    layer = model.model.layers[0].self_attn
    assert layer.q_proj.weight.grad.abs().sum() > 0 and layer.k_proj.weight.grad.abs().sum() > 0
    model.eval()
    model(input_ids=ids)
    assert selection_loss(model) is None  # evaluation computes none


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no eviction heads"):
        enable_selection_loss(tiny_model("llama"), 0.1)
    model = to_nosa(tiny_model("llama"), small_nosa_config())
    with pytest.raises(ValueError, match="weight"):
        enable_selection_loss(model, -1.0)
    with pytest.raises(ValueError, match="positions"):
        enable_selection_loss(model, 0.1, positions=0)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        enable_selection_loss(model, 0.1)
