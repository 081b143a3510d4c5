"""The tensors a graphed layer call reads, found through its arguments (``model_patches/graph_inputs.py``).

On the CPU, with transformers' own flex masks: a ``BlockMask``'s index tensors and the padding mask in its
mask function's closure are among the call's tensors; rebuilt on other tensors, the mask reads those (its
dense form follows what was copied in); masks built alike share a key without a device sync, masks built
differently do not; an argument whose state a replay would not follow is a reason, not a key. The CUDA
graphs that rely on it: ``test_backward_graphs.py::test_cuda_gpt_oss_flex_block_masks_replay_from_static_copies``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from fasttune.model_patches.graph_inputs import call_inputs
from helpers.tiny_models import FAMILY_CASES, MOE_TYPES, make_batch, tiny_model

flex = pytest.importorskip("torch.nn.attention.flex_attention")


class _Seen(Exception):
    pass


def _layer_kwargs(attention_mask, seq=150, seed=0):
    """What transformers passes gpt-oss's first decoder layer under flex attention, a sliding-window layer then
    a full one (flex has no CPU path for the sinks: the forward stops there, the masks built)."""
    out = []
    for types in (["sliding_attention", "full_attention"], ["full_attention", "sliding_attention"]):
        model = tiny_model("gpt_oss", seed=0, layer_types=types)
        model.config._attn_implementation = "flex_attention"

        def stop(m, a, k):
            out.append((a, k))
            raise _Seen

        model.model.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed))
        with pytest.raises(_Seen):
            model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
    assert all(isinstance(k["attention_mask"], flex.BlockMask) for _, k in out)
    return out


def _padded(n_pad, seq=150):
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :n_pad] = 0  # 140 of 150: row 1 loses its first 128-key block
    return mask


def _clones(inputs):
    return [t.clone() for t in inputs.tensors]


def test_block_mask_tensors_and_the_padding_in_its_closure_are_inputs():
    for args, kwargs in _layer_kwargs(_padded(5)):
        bm = kwargs["attention_mask"]
        inputs = call_inputs(args, kwargs)
        ids = {id(t) for t in inputs.tensors}
        assert {id(v) for v in vars(bm).values() if isinstance(v, torch.Tensor)} <= ids
        assert {id(kwargs["position_ids"]), *map(id, kwargs["position_embeddings"])} <= ids
        padding = [t for t in inputs.tensors if t.dtype == torch.bool and t.shape == (2, 150)]
        assert len(padding) == 1  # transformers' padding mask, from the mask function's closure


def test_a_rebuilt_mask_reads_the_tensors_it_was_rebuilt_on():
    """The rebuilt BlockMask and mask function hold the new tensors, not the old: copying another step's
    mask into them (what a replay's input copies do) gives that step's dense mask and mask function."""
    for (args5, kw5), (args140, kw140) in zip(_layer_kwargs(_padded(5)), _layer_kwargs(_padded(140))):
        inputs5, inputs140 = call_inputs(args5, kw5), call_inputs(args140, kw140)
        assert inputs5.key == inputs140.key  # built alike: one graph serves both
        static = _clones(inputs5)
        args, kwargs = inputs5.rebuild(static)
        bm = kwargs["attention_mask"]
        assert bm is not kw5["attention_mask"] and bm.mask_mod is not kw5["attention_mask"].mask_mod
        assert torch.equal(bm.to_dense(), kw5["attention_mask"].to_dense())
        for buf, t in zip(static, inputs140.tensors):
            buf.copy_(t)
        assert torch.equal(bm.to_dense(), kw140["attention_mask"].to_dense())
        assert not torch.equal(bm.to_dense(), kw5["attention_mask"].to_dense())
        q = torch.arange(150)[:, None]
        k = torch.arange(150)[None, :]
        b, h = torch.ones((), dtype=torch.long), torch.zeros((), dtype=torch.long)
        assert torch.equal(bm.mask_mod(b, h, q, k), kw140["attention_mask"].mask_mod(b, h, q, k))
        assert kw5["attention_mask"].mask_mod(b, h, q, k)[:, 20].any()  # the old mask's row 1 kept column 20
        assert not bm.mask_mod(b, h, q, k)[:, 20].any()


def test_masks_built_differently_do_not_share_a_key():
    unpadded = [call_inputs(a, k) for a, k in _layer_kwargs(None)]
    padded = [call_inputs(a, k) for a, k in _layer_kwargs(_padded(5))]
    longer = [call_inputs(a, k) for a, k in _layer_kwargs(_padded(5), seq=300)]
    for u, p, lo in zip(unpadded, padded, longer):
        assert len({u.key, p.key, lo.key}) == 3
        assert len(u.tensors) < len(p.tensors)  # no padding: nothing in the closure
    hash(unpadded[0].key)


def test_plain_values_nested_containers_and_partials():
    t = torch.randn(3)
    scale = torch.tensor(2.0)
    fn = functools.partial(torch.mul, other=scale)
    inputs = call_inputs((t, [1, (2.5, None)]), {"fn": fn, "dtype": torch.float16, "name": "x"})
    assert [id(x) for x in inputs.tensors] == [id(t), id(scale)]
    new_t, new_scale = torch.randn(3), torch.tensor(3.0)
    args, kwargs = inputs.rebuild([new_t, new_scale])
    assert args[0] is new_t and args[1] == [1, (2.5, None)]
    assert torch.equal(kwargs["fn"](new_t), new_t * 3.0) and kwargs["dtype"] is torch.float16
    with pytest.raises(ValueError, match="more tensors"):
        inputs.rebuild([new_t, new_scale, new_t])
    assert call_inputs((torch.randn(3),), {}).key != call_inputs((torch.randn(4),), {}).key
    assert call_inputs((), {"a": 1}).key != call_inputs((), {"b": 1}).key  # which keyword holds what
    assert call_inputs((), {"a": t, "b": 1}).key == call_inputs((), {"a": torch.randn(3), "b": 1}).key
    assert call_inputs((torch.randn(3),), {}).key != call_inputs((torch.randn(3).double(),), {}).key


def test_state_a_replay_would_not_follow_is_a_reason():
    from transformers import DynamicCache

    for value, name in ((SimpleNamespace(x=torch.ones(1)), "SimpleNamespace"), (DynamicCache(), "DynamicCache")):
        why = call_inputs((), {"past_key_values": value})
        assert isinstance(why, str) and name in why

    def default_tensor(x, y=torch.ones(1)):
        return x + y

    assert "tensor defaults" in call_inputs((), {"fn": default_tensor})


def test_closures_rebuilt_with_new_cells_keep_the_rest():
    offset = torch.tensor([1, 2])

    def make(k):
        def mask(b, h, q, kv):
            return (q - kv < k) & (offset[b] > 0)
        return mask

    inputs = call_inputs((), {"m": make(4)})
    assert call_inputs((), {"m": make(4)}).key == inputs.key != call_inputs((), {"m": make(5)}).key
    new = torch.tensor([0, 0])
    _, kwargs = inputs.rebuild([new])
    b, q, kv = torch.tensor(1), torch.tensor(3), torch.tensor(1)
    assert bool(make(4)(b, None, q, kv)) and not bool(kwargs["m"](b, None, q, kv))


@pytest.mark.parametrize("family", FAMILY_CASES + MOE_TYPES)
def test_every_family_layer_call_is_followed(family, monkeypatch):
    """What each supported family's checkpointed layers get under the graphs option (its KV cache dropped,
    as under HF's checkpointing) is followed: no family stays eager for an argument (CPU tensors never
    capture; the calls are read where the graphs would key them)."""
    from fasttune.config import FastConfig
    from fasttune.model_patches import forward_graphs, patch_model

    seen, run = [], forward_graphs.ForwardGraphs.run

    def recording(self, call, hidden, layer, counts):
        seen.append(call_inputs(call.args, call.kwargs))
        return run(self, call, hidden, layer, counts)

    monkeypatch.setattr(forward_graphs.ForwardGraphs, "run", recording)
    model = tiny_model(family, seed=0, **({"output_router_logits": False} if family in MOE_TYPES else {})).train()
    patch_model(model, FastConfig(checkpointing="offload", checkpoint_forward_graphs=True))
    model(**make_batch(model.config.vocab_size, seq=33)).loss.backward()
    assert len(seen) == model.config.num_hidden_layers
    assert not [why for why in seen if isinstance(why, str)]
