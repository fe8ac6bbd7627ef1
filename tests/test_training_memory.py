"""What a NOSA training step keeps on the device between its layers: no more than the dense step."""

import pytest
import torch

from hf_nosa import to_nosa
from hf_nosa.modeling import randomize_eviction_heads
from hf_nosa.attention.training import nosa_training_attention

from .conftest import SPARSE, small_nosa_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _live_tensor_bytes(skip: set[int]) -> dict:
    """Bytes of every live plain tensor storage outside ``skip`` (storage pointers) by (shape, dtype)."""
    import gc

    gc.collect()
    seen, out = set(skip), {}
    for obj in gc.get_objects():
        # exactly torch.Tensor: parameters, and the fake tensors earlier compiles may leave, hold no memory of a step
        if type(obj) is torch.Tensor:
            ptr = obj.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                key = (tuple(obj.shape), str(obj.dtype))
                out[key] = out.get(key, 0) + obj.untyped_storage().nbytes()
    return out


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_checkpointed_sparse_step_keeps_what_dense_keeps_at_the_loss_interpreted(interpret, monkeypatch):
    """At the loss, where a retrofit step peaks, a NOSA step under non-reentrant gradient checkpointing keeps alive
    what the dense step keeps plus its held forwards (on CUDA in pinned host memory, not on the device): no
    selection bitmap, plan, partial output or fingerprint sample outlives its layer. Sparse kernels, interpreted;
    the second step's forward, so that nothing of the first step's backward is left either."""
    import functools

    import hf_nosa.modeling.attention as attention
    from hf_nosa.attention import held_forward

    sparse = functools.partial(nosa_training_attention, backend="sparse")
    monkeypatch.setattr(attention, "nosa_training_attention", sparse)
    ids = torch.randint(3, 97, (1, 96), generator=torch.Generator().manual_seed(8))  # 6 blocks, a budget of 4
    census = {}
    for mode in ("dense", "nosa"):
        model = tiny_model("llama", seed=4, num_hidden_layers=1)  # what one layer leaves, every layer leaves
        if mode == "nosa":
            model = randomize_eviction_heads(to_nosa(model, small_nosa_config(**SPARSE)),
                                             generator=torch.Generator().manual_seed(11))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model(ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        held = held_forward.live()
        assert len(held) == (model.config.num_hidden_layers if mode == "nosa" else 0)
        kept = [t for h in held for t in (*(h._outputs or ()), h._indices, h._numbers) if t is not None]
        held_forward._sample_indices.cache_clear()
        census[mode] = _live_tensor_bytes({t.untyped_storage().data_ptr() for t in [*kept, *model.buffers()]})
        loss.backward()
        del model, loss, held, kept
    extra = {k: n - census["dense"].get(k, 0) for k, n in census["nosa"].items() if n > census["dense"].get(k, 0)}
    assert extra == {}
    # and less: the final norm keeps its input and one scale per row where autograd also keeps the normalized rows
    # (RMSNormSavingInput)
    assert sum(census["nosa"].values()) < sum(census["dense"].values())
