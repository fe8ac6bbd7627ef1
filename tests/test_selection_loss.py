"""The alignment losses (query-aware and eviction): values against per-position references, gradients, plumbing."""

import pytest
import torch

from hf_nosa import to_nosa
from hf_nosa.rules.selection import compress_keys, eviction_block_scores, query_block_scores
from hf_nosa.attention.selection_loss import (
    enable_selection_loss,
    eviction_alignment_loss,
    sampled_positions,
    selection_alignment_loss,
    selection_loss,
)

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


def _eviction_reference(query, key, bias, cfg, scale, positions):
    """One position and head at a time: dense block mass vs softmax of the eviction block score over the candidates."""
    B, H, T, D = query.shape
    Hk = key.shape[1]
    G, P = H // Hk, cfg.block_size
    N = -(-T // P)
    kls = []
    for t in sampled_positions(T, cfg, positions).tolist():
        among = list(range(cfg.sink_blocks, t // P - cfg.local_blocks))
        score = eviction_block_scores(compress_keys(bias.float(), cfg), torch.tensor([t]), N, cfg)[:, :, 0]
        for b in range(B):
            for h in range(Hk):
                mass = torch.zeros(N)
                for g in range(G):
                    p = torch.softmax(query[b, h * G + g, t].float() @ key[b, h, : t + 1].float().T * scale, -1)
                    for n in range(N):
                        mass[n] += p[n * P : (n + 1) * P].sum()
                target = mass[among] / mass[among].sum()
                log_predicted = torch.log_softmax(score[b, h, among], -1)
                kls.append((target * (target.log() - log_predicted)).sum())
    return torch.stack(kls).mean()


@pytest.mark.parametrize("group", [1, 2])
def test_eviction_loss_equals_per_position_reference(group):
    cfg = small_nosa_config()
    torch.manual_seed(10 + group)
    B, Hk, T, D = 2, 2, 200, 16
    q, k, bias = torch.randn(B, Hk * group, T, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T)
    loss = eviction_alignment_loss(q, k, bias, cfg, D**-0.5, positions=7)
    torch.testing.assert_close(loss, _eviction_reference(q, k, bias, cfg, D**-0.5, 7), atol=1e-5, rtol=1e-4)
    assert loss > 0


def test_eviction_loss_teaches_the_head_the_block_attention_returns_to():
    """A block every later query attends to: the trained eviction head must rank it first, from A = 0."""
    cfg = small_nosa_config()  # blocks of 16, sink 1, local 2
    torch.manual_seed(0)
    T, D, P = 256, 16, cfg.block_size
    key = torch.randn(1, 1, T, D)
    needle = 5  # a block outside the sink and the local window of every sampled position
    query = key[:, :, needle * P : (needle + 1) * P].mean(2, keepdim=True).expand(1, 2, T, D) * 4
    value = torch.randn(1, T, 8)
    value[:, needle * P : (needle + 1) * P] += 3.0  # what the head can tell the needle's tokens by
    delta = torch.nn.Linear(8, 1)
    A = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([A, *delta.parameters()], lr=5e-2)
    from hf_nosa.rules.selection import eviction_bias

    losses = []
    for _ in range(80):
        optimizer.zero_grad()
        bias = eviction_bias(value, delta.weight, delta.bias, A)  # [1, 1, T]
        loss = eviction_alignment_loss(query, key, bias, cfg, D**-0.5, positions=12)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():
        bias = eviction_bias(value, delta.weight, delta.bias, A)
        blocks = eviction_block_scores(compress_keys(bias, cfg), torch.tensor([T - 1]), T // P, cfg)[0, 0, 0]
    candidates = blocks[cfg.sink_blocks : T // P - cfg.local_blocks - 1]
    assert int(candidates.argmax()) + cfg.sink_blocks == needle


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


def test_eviction_loss_plumbing_trains_the_eviction_head_from_zero():
    """Through the attention bias alone, A = 0 gives delta no gradient; the eviction loss gives both one."""
    cfg = small_nosa_config()
    model = to_nosa(tiny_model("llama"), cfg).train()
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    head = model.model.layers[0].self_attn.eviction_head
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    assert head.delta.weight.grad is None or head.delta.weight.grad.abs().sum() == 0
    model.zero_grad()
    enable_selection_loss(model, 0.0, positions=8, eviction_weight=1.0)
    model(input_ids=ids)
    aux = selection_loss(model)
    assert aux is not None and aux > 0
    aux.backward()
    assert head.A.grad.abs().sum() > 0
    # the values are detached: v_proj learns from the language-model loss alone
    assert model.model.layers[0].self_attn.v_proj.weight.grad is None


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no eviction heads"):
        enable_selection_loss(tiny_model("llama"), 0.1)
    model = to_nosa(tiny_model("llama"), small_nosa_config())
    with pytest.raises(ValueError, match="weight"):
        enable_selection_loss(model, -1.0)
    with pytest.raises(ValueError, match="eviction_weight"):
        enable_selection_loss(model, 0.0, eviction_weight=-0.5)
    with pytest.raises(ValueError, match="positions"):
        enable_selection_loss(model, 0.1, positions=0)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        enable_selection_loss(model, 0.1)
