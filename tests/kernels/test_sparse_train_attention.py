"""The sparse training attention (Triton, forward and backward) against its torch reference, and its plan against a
brute-force count.

CPU cases run the kernels in the Triton interpreter (``TRITON_INTERPRET=1``, set per test) at small sizes: blocks
of 16 keys (and one of 8), ragged last blocks, query tiles split into several programs, GQA groups of 1, 2, 3 and 4,
left padding with queries inside it, extreme biases; outputs and the gradients of query, key, value and bias. The
bitmaps are random over all blocks (past and future ones too): the kernels must follow the rule, not the selection's
habits. The ``gpu`` cases run the compiled kernels at training-like sizes. The kernels here are the default path
(split: shared blocks and extras, ``sparse_train_split.py``); ``test_sparse_train_split.py`` holds it to bitmaps
shaped like NOSA's selections, where both of its parts have work, and runs the union path too.
"""

import importlib
import math

import pytest
import torch

from hf_nosa.kernels.train.sparse_train_common import ROW_DOT_ROWS, row_dot, row_dot_ref
from hf_nosa.rules.selection import MASK_VALUE

from ..utils import assert_close

sparse_module = importlib.import_module("hf_nosa.kernels.train.sparse_train_attention")
plan_module = importlib.import_module("hf_nosa.kernels.train.sparse_train_plan")
needs_triton = pytest.mark.skipif(not sparse_module.HAS_TRITON, reason="needs the triton package")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _inputs(B, H, Hk, T, q_offset, D, P, dtype=torch.float32, device="cpu", seed=0, extreme=False, pads=None,
            density=0.3):
    """Random q, k, v, a nonzero bias (``extreme``: up to +-80), a random bitmap and the offsets of ``pads`` (whose
    keys get MASK_VALUE in the bias, as training folds the padding in)."""
    g = torch.Generator().manual_seed(seed)
    Tq, N = T - q_offset, math.ceil(T / P)
    q = torch.randn(B, H, Tq, D, generator=g)
    k, v = torch.randn(B, Hk, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g)
    bias = torch.randn(B, Hk, T, generator=g)
    if extreme:
        bias = (bias * 40).clamp(-80, 80)
        bias[..., 1::7] = 80.0
        bias[..., 2::5] = -80.0
    bitmap = torch.rand(B, Hk, Tq, N, generator=g) < density
    offsets = None
    if pads is not None:
        offsets = torch.tensor(pads)
        for row, pad in enumerate(pads):
            bias[row, :, :pad] = MASK_VALUE
    q, k, v = (t.to(dtype).to(device) for t in (q, k, v))
    return q, k, v, bias.to(device), bitmap.to(device), offsets


def _run(fn, q, k, v, bias, bitmap, upstream, **kwargs):
    """Output and the gradients of q, k, v, bias under ``(out * upstream).sum()``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves, bitmap, 0.3, **kwargs)
    (out.float() * upstream).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


CASES = [
    # B, H, Hk, T, q_offset, D, P, pads, tile, config, extreme
    (1, 2, 2, 16, 0, 16, 16, None, 32, None, False),  # one block, no GQA
    (2, 4, 2, 47, 0, 32, 16, None, 32, None, True),  # ragged last block, two programs per tile, extreme bias
    (2, 4, 2, 64, 20, 16, 16, None, 16, None, False),  # queries after 20 keys, tiles of 8 tokens
    (1, 4, 1, 100, 37, 16, 16, None, 64, (32, 4, 1), True),  # GQA 4, one program per tile of 16 tokens
    (2, 4, 2, 70, 0, 16, 16, (13, 40), 32, None, False),  # left padding, 13 and 40 not whole blocks
    (2, 2, 2, 64, 30, 16, 16, (5, 40), 32, None, True),  # row 1: queries 30 .. 39 inside the padding
    (1, 6, 2, 47, 5, 16, 16, None, 32, None, False),  # GQA 3: tiles of 10 tokens (30 of 32 rows used)
    (2, 4, 2, 40, 3, 24, 8, (0, 9), 32, None, False),  # head dim 24 (padded to 32), blocks of 8 (key tiles of 16)
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_kernels_match_reference_with_gradients_interpreted(interpret, case):
    B, H, Hk, T, q_offset, D, P, pads, tile, config, extreme = case
    q, k, v, bias, bitmap, offsets = _inputs(B, H, Hk, T, q_offset, D, P, seed=T + H, extreme=extreme, pads=pads)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    kwargs = dict(block_size=P, q_offset=q_offset, offsets=offsets)
    got = _run(sparse_module.sparse_train_attention, q, k, v, bias, bitmap, upstream, tile=tile, config=config,
               **kwargs)
    want = _run(sparse_module.sparse_train_attention_ref, q, k, v, bias, bitmap, upstream, **kwargs)
    for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert expected.abs().sum() > 0, f"{name} is zero: the comparison would prove nothing"
        assert_close(actual, expected, atol=1e-4, rtol=1e-4, msg=name)
    if pads is not None:  # keys inside the padding take no part
        for row, pad in enumerate(pads):
            assert got[2][row, :, :pad].abs().sum() == 0 and got[4][row, :, :pad].abs().sum() == 0


@needs_triton
def test_strided_layouts_give_the_same_result_interpreted(interpret):
    """The models' layout (``[B, T, H, D]`` transposed) and a sliced head dim: the result and gradients of
    contiguous inputs."""
    q, k, v, bias, bitmap, offsets = _inputs(1, 4, 2, 40, 8, 16, 16, seed=4, pads=(3,))
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    kwargs = dict(block_size=16, q_offset=8, offsets=offsets, tile=32)
    expected = _run(sparse_module.sparse_train_attention, q, k, v, bias, bitmap, upstream, **kwargs)
    q_rows, k_rows = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k))  # [B, T, H, D]
    v_wide = torch.cat([v, v], -1).requires_grad_()
    bias = bias.clone().requires_grad_()
    out = sparse_module.sparse_train_attention(q_rows.transpose(1, 2), k_rows.transpose(1, 2), v_wide[..., :16],
                                               bias, bitmap, 0.3, **kwargs)
    (out * upstream).sum().backward()
    got = [out.detach(), q_rows.grad.transpose(1, 2), k_rows.grad.transpose(1, 2), v_wide.grad[..., :16], bias.grad]
    for name, actual, want in zip(("out", "dq", "dk", "dv", "dbias"), got, expected):
        assert torch.equal(actual, want), name
    assert v_wide.grad[..., 16:].abs().sum() == 0


@needs_triton
def test_bf16_matches_reference_interpreted(interpret):
    q, k, v, bias, bitmap, offsets = _inputs(2, 4, 2, 64, 16, 32, 16, dtype=torch.bfloat16, seed=3, pads=(0, 21))
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    kwargs = dict(block_size=16, q_offset=16, offsets=offsets)
    got = _run(sparse_module.sparse_train_attention, q, k, v, bias, bitmap, upstream, tile=32, **kwargs)
    want = _run(sparse_module.sparse_train_attention_ref, q.float(), k.float(), v.float(), bias, bitmap, upstream,
                **kwargs)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16 and got[4].dtype == torch.float32
    for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert_close(actual, expected, atol=3e-2, rtol=3e-2, msg=name)


def _brute_force_visits(bitmap, G, P, q_offset, offsets, tokens):
    """Per (b, hk, tile) the set of blocks visited, by loops over tokens."""
    B, Hk, Tq, N = bitmap.shape
    visits = {}
    for b in range(B):
        off = 0 if offsets is None else int(offsets[b])
        for hk in range(Hk):
            for i in range(math.ceil(Tq / tokens)):
                seen = set()
                for t in range(i * tokens, min(Tq, (i + 1) * tokens)):
                    seen |= {n for n in range(N) if bitmap[b, hk, t, n]}
                    pos = q_offset + t - off
                    if pos >= 0:
                        seen.add(pos // P)
                visits[b, hk, i] = seen
    return visits


@pytest.mark.parametrize("G,tile,q_offset,pads", [(1, 16, 0, None), (2, 32, 21, None), (4, 32, 0, (0, 19)),
                                                  (3, 32, 40, (7, 50)), (8, 4, 9, None)])
def test_plan_lists_equal_a_brute_force_count(G, tile, q_offset, pads):
    B, Hk, P, T = 2, 2, 8, 70
    Tq, N = T - q_offset, math.ceil(T / P)
    bitmap = torch.rand(B, Hk, Tq, N, generator=torch.Generator().manual_seed(G)) < 0.15
    offsets = torch.tensor(pads) if pads is not None else None
    plan = plan_module.sparse_train_plan(bitmap, heads=G * Hk, block_size=P, q_offset=q_offset, offsets=offsets,
                                         tile=tile)
    assert plan.tokens == max(1, tile // G)
    visits = _brute_force_visits(bitmap, G, P, q_offset, offsets, plan.tokens)
    n_qt = math.ceil(Tq / plan.tokens)
    assert plan.blocks.shape == (B, Hk, n_qt, N) and plan.tiles.shape == (B, Hk, N, n_qt)
    for (b, hk, i), seen in visits.items():
        count = int(plan.counts[b, hk, i])
        assert plan.blocks[b, hk, i, :count].tolist() == sorted(seen), (b, hk, i)
    for b in range(B):
        for hk in range(Hk):
            for n in range(N):
                count = int(plan.tile_counts[b, hk, n])
                expected = [i for i in range(n_qt) if n in visits[b, hk, i]]
                assert plan.tiles[b, hk, n, :count].tolist() == expected, (b, hk, n)


def test_bad_inputs_are_refused_by_name():
    q, k, v, bias, bitmap, _ = _inputs(1, 4, 2, 40, 8, 16, 16)
    attention = sparse_module.sparse_train_attention
    cases = [
        (dict(bias=bias.double()), "bias must be float32"),
        (dict(bias=bias[..., 1:]), "bias must be float32"),
        (dict(bitmap=bitmap[..., :2]), "bitmap must be bool"),
        (dict(bitmap=bitmap.float()), "bitmap must be bool"),
        (dict(offsets=torch.zeros(1)), "offsets must be an integer"),
        (dict(offsets=torch.zeros(2, dtype=torch.long)), "offsets must be an integer"),
        (dict(q_offset=7), "q_offset=7"),
        (dict(k=k.double()), "share a dtype"),
        (dict(q=q[:, :3]), "H % Hk"),
        (dict(v=v[..., :8]), "key/value"),
        (dict(block_size=24), "block_size=24"),
        (dict(config=(24, 4, 1)), "config="),
        (dict(tile=0), "tile=0"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, bias=bias, bitmap=bitmap, q_offset=8, block_size=16, offsets=None)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            attention(args["q"], args["k"], args["v"], args["bias"], args["bitmap"], 0.25,
                      block_size=args["block_size"], q_offset=args["q_offset"], offsets=args["offsets"],
                      **{key: change[key] for key in ("tile", "config") if key in change})


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    q, k, v, bias, bitmap, offsets = _inputs(2, 4, 2, 40, 8, 16, 16, pads=(0, 5))
    out = sparse_module.sparse_train_attention(q, k, v, bias, bitmap, 0.25, block_size=16, q_offset=8,
                                               offsets=offsets)
    expected = sparse_module.sparse_train_attention_ref(q, k, v, bias, bitmap, 0.25, block_size=16, q_offset=8,
                                                        offsets=offsets)
    assert torch.equal(out, expected)


def test_reference_equals_the_training_token_mask():
    """The reference's rule is ``training._token_mask``: the same output as attending with that mask."""
    from hf_nosa.rules.attend import AttentionInputs, attend
    from hf_nosa.attention.training import _positions, _token_mask

    q, k, v, bias, bitmap, offsets = _inputs(2, 4, 2, 70, 6, 16, 16, pads=(0, 11), density=0.2)
    mask = _token_mask(bitmap, _positions(6, 70, offsets, "cpu"), 70, 16, offsets)
    expected = attend(q, AttentionInputs(k, v, bias, torch.where(mask, 0.0, MASK_VALUE), 6, causal=False), 0.25)
    out = sparse_module.sparse_train_attention_ref(q, k, v, bias, bitmap, 0.25, block_size=16, q_offset=6,
                                                   offsets=offsets)
    seen = mask.any(-1).repeat_interleave(2, dim=1)
    assert_close(out[seen], expected[seen], atol=1e-6, rtol=1e-6)
    assert out[~seen].abs().sum() == 0 and (~seen).any()  # queries 6 .. 10 of row 1 are padding and see nothing


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)])
def test_kernels_match_reference_on_gpu(dtype, D):
    for B, H, Hk, T, q_offset, pads in ((2, 8, 2, 1000, 0, None), (2, 32, 8, 1500, 300, (0, 333)),
                                         (1, 4, 4, 700, 0, None)):
        q, k, v, bias, bitmap, offsets = _inputs(B, H, Hk, T, q_offset, D, 64, dtype=dtype, device="cuda", seed=T,
                                                 extreme=True, pads=pads, density=0.1)
        upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).cuda()
        offsets = offsets.cuda() if offsets is not None else None
        kwargs = dict(block_size=64, q_offset=q_offset, offsets=offsets)
        got = _run(sparse_module.sparse_train_attention, q, k, v, bias, bitmap, upstream, **kwargs)
        want = _run(sparse_module.sparse_train_attention_ref, q.float(), k.float(), v.float(), bias, bitmap,
                    upstream, **kwargs)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
            scale = 1 if name == "out" else 10
            assert_close(actual, expected, atol=tol * scale, rtol=tol * scale, msg=f"{name} T={T} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_backend_on_gpu_equals_explicit(dtype):
    from hf_nosa import NosaConfig
    from hf_nosa.attention.training import nosa_training_attention

    cfg = NosaConfig(block_size=64, budget_tokens=512, query_tokens=128, sink_tokens=64, local_tokens=128,
                     compress_kernel=32, compress_stride=16)
    results = {}
    for backend in ("explicit", "sparse"):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, 2000, 64, generator=g).to("cuda", dtype).requires_grad_() for h in (8, 2, 2))
        bias = torch.randn(2, 2, 2000, generator=g).cuda().requires_grad_()
        out = nosa_training_attention(q, k, v, bias, cfg, 0.125, backend=backend)
        out.float().pow(2).sum().backward()
        results[backend] = [out.detach()] + [x.grad for x in (q, k, v, bias)]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), results["sparse"], results["explicit"]):
        scale = 1 if name == "out" else 10
        assert_close(actual, expected, atol=tol * scale, rtol=tol * scale, msg=name)


def test_docstring_examples():
    import doctest

    assert doctest.testmod(sparse_module, raise_on_error=True).attempted > 0
    assert doctest.testmod(plan_module, raise_on_error=True).attempted > 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_dot_matches_its_reference(interpret, dtype):
    """The backward's delta = rowsum(dO * O) in one pass: rows past a program's, a head dim that is not a power of
    two, a strided output (the width-padded layout)."""
    g = torch.Generator().manual_seed(11)
    grad = torch.randn(2, 3, ROW_DOT_ROWS + 7, 24, generator=g).to(dtype)
    out = torch.randn(2, 3, ROW_DOT_ROWS + 7, 32, generator=g).to(dtype)[..., :24]
    delta = row_dot(grad, out)
    assert delta.dtype == torch.float32 and delta.shape == (2, 3, ROW_DOT_ROWS + 7)
    assert_close(delta, row_dot_ref(grad, out), atol=1e-4, rtol=1e-5)
