"""The replay of DeepSpeed ZeRO-3's parameter coordinator (analytic/zero3.py) at its limits, against sums over
the parameter inventory: with no prefetch and no reuse window every module's parameters are released after it
runs; with a window wider than the model nothing is released in the forward. (The replay against the real
engine: tests/trace/test_deepspeed.py::test_zero3_rank_agrees_with_trace.)"""

from __future__ import annotations

import dataclasses

from trainfit.analytic.model import MomentName
from trainfit.analytic.zero3 import PERSISTENCE_THRESHOLD, gathered_bytes, module_order
from trainfit.arch.config import spec_from_config
from trainfit.arch.params import inventory
from trainfit.cuda_facts import allocator_bytes
from trainfit.strategy import EngineOptions, Parallelism, Strategy, finetune_setup

CONFIG = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
W = 8


def _strategy(prefetch: int, reuse: int) -> Strategy:
    return Strategy(
        parallelism=Parallelism(data=W),
        sharding="zero3",
        engine=EngineOptions(prefetch_bucket_size=prefetch, max_reuse_distance=reuse),
    )


def _partitioned() -> list[int]:
    spec = spec_from_config(CONFIG, name="t", source="test")
    return [t.numel for t, m in inventory(spec).all_tensors() for _ in range(m) if t.numel > PERSISTENCE_THRESHOLD]


def test_order_has_every_parameter_once_forward_and_once_backward() -> None:
    spec = spec_from_config(CONFIG, name="t", source="test")
    params, order = module_order(spec, _strategy(0, 0))
    assert sorted(p.numel for p in params) == sorted(
        t.numel for t, m in inventory(spec).all_tensors() for _ in range(m)
    )
    uses = [q for st in order for q in st.params]
    assert sorted(uses) == sorted(list(range(len(params))) * 2)


def test_no_prefetch_no_reuse_releases_each_module() -> None:
    spec = spec_from_config(CONFIG, name="t", source="test")
    g = gathered_bytes(spec, _strategy(0, 0), W, 2)
    assert g.at[MomentName.FORWARD_END] == 0
    # the worst moment: one module's coalesced all-gather buffer (W partitions) and its whole copy
    largest = max(_partitioned())
    assert g.peak_bytes == allocator_bytes(-(-largest // W) * W * 2) + allocator_bytes(largest * 2)


def test_a_window_wider_than_the_model_keeps_everything_gathered() -> None:
    spec = spec_from_config(CONFIG, name="t", source="test")
    g = gathered_bytes(spec, _strategy(0, 10**12), W, 2)
    assert g.at[MomentName.FORWARD_END] == sum(allocator_bytes(n * 2) for n in _partitioned())


def test_a_prefetch_bucket_larger_than_the_model_gathers_it_in_one_handle() -> None:
    """DeepSpeed's default bucket (5e7) on a small model: the first module's prefetch all-gathers every
    partitioned parameter into one flat buffer (W padded partitions each), which lives until the last of its
    parameters, the LM head, is fetched; the first wait copies every parameter out whole
    (partition_parameters.py ``AllGatherCoalescedHandle.wait``). Inside the final norm both are alive; at the
    forward's end (after the head's fetch) only the whole copies."""
    spec = spec_from_config(CONFIG, name="t", source="test")
    s = Strategy(parallelism=Parallelism(data=W), sharding="zero3")
    assert s.engine.prefetch_bucket_size > sum(_partitioned())
    g = gathered_bytes(spec, s, W, 2)
    whole = sum(allocator_bytes(n * 2) for n in _partitioned())
    flat = allocator_bytes(sum(-(-n // W) for n in _partitioned()) * W * 2)
    assert g.at[MomentName.FORWARD_FINAL_NORM] == whole + flat
    assert g.at[MomentName.FORWARD_END] == whole


def test_dead_layers_and_a_frozen_embedding_run_no_backward_fetch() -> None:
    """Fine-tuning: DeepSpeed's pre-backward hook wraps only outputs that require grad, so under ``--freeze
    embeddings,layers:0-1`` (no checkpointing) the two dead layers and the table are fetched in forward only: with a
    reuse window wider than the model they are released after their forward instead of staying gathered into the
    backward (the traced engine: the closed form was +12% in forward with their backward in the order). Under LoRA
    every layer runs a backward, the frozen table does not. The replays are memoised apart (they shared one)."""
    spec = spec_from_config(CONFIG, name="t", source="test")
    full = _strategy(0, 10**12)
    adapter, base = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    freeze = dataclasses.replace(full, adapter=adapter, base_weights=base)
    lora = dataclasses.replace(full, adapter=finetune_setup("lora")[0])
    _, order = module_order(spec, freeze)
    backward = {st.where for st in order if not st.forward}
    assert not backward & {"bwd-L0", "bwd-L1", "bwd-embed"} and {"bwd-L2", "bwd-L3"} <= backward
    _, order = module_order(spec, lora)
    assert "bwd-embed" not in {st.where for st in order} and "bwd-L0" in {st.where for st in order}
    every = gathered_bytes(spec, full, W, 2).at[MomentName.FORWARD_END]
    g = gathered_bytes(spec, freeze, W, 2).at[MomentName.FORWARD_END]
    inv = inventory(spec)
    layer = sum(allocator_bytes(t.numel * 2) for t in inv.layers[0].tensors if t.numel > PERSISTENCE_THRESHOLD)
    table = sum(
        allocator_bytes(t.numel * 2)
        for t in inv.model_tensors
        if t.name.startswith("embed") and t.numel > PERSISTENCE_THRESHOLD
    )
    assert layer > 0 and table > 0
    assert g == every - 2 * layer - table  # the dead layers' and the table's gathered copies released
    assert gathered_bytes(spec, full, W, 2).at[MomentName.FORWARD_END] == every  # not the freeze replay's


def test_zero_infinity_copies_each_fetched_partition_to_the_device_first() -> None:
    """ZeRO-Infinity: the all-gather's input is each fetched parameter's partition copied from the host
    (partition_parameters.py ``_all_gather_dtype``: ``torch.cat([p.ds_tensor.to(device) ...])``), freed once in the
    flat buffer: one module's worst moment is its flat buffer, its partitions' copies and nothing else yet, then the
    flat buffer and its whole copy as on the device."""
    from trainfit.strategy import Offload

    spec = spec_from_config(CONFIG, name="t", source="test")
    s = dataclasses.replace(_strategy(0, 0), offload=Offload.parse("optimizer+params"))
    g = gathered_bytes(spec, s, W, 2)
    largest = max(_partitioned())
    flat = allocator_bytes(-(-largest // W) * W * 2)
    assert g.peak_bytes == flat + max(allocator_bytes(largest * 2), allocator_bytes(-(-largest // W) * 2))
    on_device = gathered_bytes(spec, _strategy(0, 0), W, 2)
    copies = [n for _, _, n in g.events if 0 < n == allocator_bytes(-(-largest // W) * 2)]
    assert len(copies) > len([n for _, _, n in on_device.events if 0 < n == allocator_bytes(-(-largest // W) * 2)])


def test_one_rank_gathers_nothing_but_zero_infinity_copies_each_parameter_in() -> None:
    """A partition world of 1: ``all_gather_coalesced`` returns ``_no_gather_coalesced`` (``NoGatherHandle``:
    ``param.data = ds_tensor.to(device)``): with the partitions on the device nothing is allocated (the traced engine
    at one rank: no gathered parameters); under ZeRO-Infinity each parameter is copied in whole, no flat buffer."""
    from trainfit.strategy import Offload

    spec = spec_from_config(CONFIG, name="t", source="test")
    one = dataclasses.replace(_strategy(0, 10**12), parallelism=Parallelism(data=1))
    assert gathered_bytes(spec, one, 1, 2).peak_bytes == 0
    inf = gathered_bytes(spec, dataclasses.replace(one, offload=Offload.parse("optimizer+params")), 1, 2)
    assert inf.at[MomentName.FORWARD_END] == sum(allocator_bytes(n * 2) for n in _partitioned())
    assert sorted(n for _, _, n in inf.events if n) == sorted(allocator_bytes(n * 2) for n in _partitioned())
