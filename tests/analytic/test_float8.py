"""``--fp8 tensorwise`` in the analytic model, against closed forms read from torchao's source (torch-free).

torchao 0.18 ``Float8Linear`` (torchao/float8/float8_linear.py ``matmul_with_hp_or_float8_args``) saves the
high-precision input and the weight's view, so saved activations equal the bf16 linear's; under autocast it
never casts its fp32 weight to bf16 (no cached copy). One dynamic cast (float8_training_tensor.py
``_ToFloat8ConstrFunc.forward``, float8_utils.py ``to_fp8_saturated``) is replayed here as its own sequence of
allocations and frees, independently of the code's 9-bytes-per-element constant.
"""

from __future__ import annotations

import json

import pytest

from trainfit.analytic.float8 import block_linears, cast_peak_bytes, check_float8, linear_backward_extra
from trainfit.analytic.model import stack_activations, step_inputs
from trainfit.analytic.states import model_states
from trainfit.arch.config import spec_from_config
from trainfit.arch.params import inventory
from trainfit.cuda_facts import allocator_bytes
from trainfit.errors import StrategyError
from trainfit.estimate import estimate
from trainfit.strategy import Offload, Parallelism, Strategy

from ..cli._cli_helper import run_cli

LLAMA = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 64,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip


def _spec(**over: object) -> object:
    return spec_from_config({**LLAMA, **over}, name="tiny-llama-fp8", source="test")


def _replay_cast(numel: int, in_bytes: int) -> int:
    """Peak live bytes (besides the input) of ``hp_tensor_to_float8_dynamic`` on ``numel`` elements of width
    ``in_bytes``, statement by statement: abs → max (abs freed) ; x.to(fp32) (a copy unless fp32) * scale
    (copy freed) ; clamp ; .to(float8) — ``tensor_scaled`` and the clamped copy are locals until it returns."""
    live, peak = 0, 0

    def alloc(n: int) -> None:
        nonlocal live, peak
        live += n
        peak = max(peak, live)

    alloc(in_bytes * numel)  # torch.abs(x)
    live -= in_bytes * numel  # freed after torch.max
    copy = 4 * numel if in_bytes != 4 else 0
    alloc(copy)  # tensor.to(torch.float32)
    alloc(4 * numel)  # * scale
    live -= copy
    alloc(4 * numel)  # x.clamp(min=-max, max=max)
    alloc(numel)  # .to(float8_dtype)
    return peak


@pytest.mark.parametrize("in_bytes", [2, 4])
def test_cast_peak_matches_the_replayed_source(in_bytes: int) -> None:
    assert cast_peak_bytes(1000) == _replay_cast(1000, in_bytes)


def test_saved_activations_are_the_bf16_linears() -> None:
    spec = _spec()
    for precision in ("pure-bf16", "amp-bf16"):
        plain = Strategy(precision=precision, micro_batch=2, seq_len=256)
        fp8 = Strategy(precision=precision, micro_batch=2, seq_len=256, float8="tensorwise")
        a = stack_activations(spec, plain, model_states(spec, plain))
        b = stack_activations(spec, fp8, model_states(spec, fp8))
        assert a.all_layers_bytes == b.all_layers_bytes


def test_autocast_copies_only_of_unconverted_weights() -> None:
    """Under amp-bf16 every block linear is converted: only the LM head keeps its bf16 autocast copy."""
    spec = _spec()
    s = Strategy(precision="amp-bf16", float8="tensorwise")
    head = next(t for t in inventory(spec).model_tensors if t.name.startswith("lm_head"))
    assert model_states(spec, s).autocast_copies_bytes == allocator_bytes(2 * head.numel)


def test_filter_keeps_linears_whose_dims_are_not_multiples_of_16() -> None:
    """torchtitan's module_filter_fn: intermediate 1000 leaves gate/up/down in bf16; their copies remain."""
    spec = _spec(intermediate_size=1000)
    conv = {x.name: x.converted for x in block_linears(spec)}
    assert conv == {
        "attn.q_proj.weight": True, "attn.k_proj.weight": True, "attn.v_proj.weight": True,
        "attn.o_proj.weight": True, "mlp.gate_proj.weight": False, "mlp.up_proj.weight": False,
        "mlp.down_proj.weight": False,
    }  # fmt: skip
    s = Strategy(precision="amp-bf16", float8="tensorwise")
    mlp = 3 * 128 * 1000 * 2 * spec.num_layers
    head = 64 * 128 * 2
    assert model_states(spec, s).autocast_copies_bytes == allocator_bytes(head) + mlp


def test_backward_transient_reaches_the_block_moment() -> None:
    spec = _spec()
    s = Strategy(precision="pure-bf16", micro_batch=2, seq_len=256, float8="tensorwise")
    t = 512
    worst = max(linear_backward_extra(t, x.in_features, x.out_features) for x in block_linears(spec))
    # gate/up (k = 128 → n = 1024): the second grad_output cast with go8 and w8 held, 10·t·n + n·k
    assert worst == linear_backward_extra(t, 128, 1024) == 10 * t * 1024 + 1024 * 128
    # down (k = 1024 → n = 128): the input's cast with both grad_output copies and w8 held, 2·t·n + n·k + 9·t·k
    assert linear_backward_extra(t, 1024, 128) == 2 * t * 128 + 128 * 1024 + 9 * t * 1024
    assert step_inputs(spec, s, keep_logits=False).block_temp >= worst


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"precision": "fp32"}, "--precision fp32"),
        ({"precision": "amp-fp16"}, "--precision amp-fp16"),
        ({"sharding": "zero3"}, "this layout"),
        ({"sharding": "fsdp", "offload": Offload.parse("optimizer")}, "this layout"),
    ],
)
def test_strategy_refusals(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(StrategyError, match=words):
        Strategy(float8="tensorwise", **kwargs)  # type: ignore[arg-type]


def test_torch_data_parallel_layouts_are_modelled() -> None:
    for sharding in ("ddp", "fsdp", "hsdp"):
        s = Strategy(float8="tensorwise", precision="amp-bf16", sharding=sharding, parallelism=Parallelism(data=16))
        assert s.float8.value == "tensorwise"


def test_model_refusals() -> None:
    moe = spec_from_config(
        {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, name="m", source="test"
    )
    with pytest.raises(StrategyError, match="MoE"):
        check_float8(moe, Strategy(precision="pure-bf16", float8="tensorwise"))
    odd = _spec(hidden_size=120, intermediate_size=1000, head_dim=30)
    with pytest.raises(StrategyError, match="divisible by 16"):
        check_float8(odd, Strategy(precision="pure-bf16", float8="tensorwise"))


def test_gpu_without_fp8_is_refused() -> None:
    s = Strategy(precision="pure-bf16", float8="tensorwise")
    with pytest.raises(StrategyError, match=r"compute capability >= 8\.9"):
        estimate(_spec(), s, gpu="a100-sxm-80gb")
    assert estimate(_spec(), s, gpu="h100-sxm-80gb").peak_bytes > 0


def test_cli_flag_json_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "estimate", "llama-3.2-1b", "--fp8", "tensorwise", "--seq", "256", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["strategy"]["float8"] == "tensorwise"
    r = run_cli(capsys, "estimate", "llama-3.2-1b", "--fp8", "tensorwise", "--gpu", "a100-sxm-80gb")
    assert r.code == 2 and r.err.count("\n") == 1 and "8.9" in r.err


def test_unknown_fp8_recipe_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "estimate", "llama-3.2-1b", "--fp8", "rowwise")
    assert r.code == 2 and r.err.strip() == "error: unknown --fp8 'rowwise'; choose one of: none, tensorwise"
