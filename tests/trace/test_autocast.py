"""CUDA autocast policy on CPU tensors: the table matches what the installed torch registers for
AutocastCUDA, and under the emulation ops return CUDA's dtypes; leaving restores CPU autocast."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainfit.trace import autocast as ac  # noqa: E402


def test_table_matches_the_installed_autocast_cuda_kernels() -> None:
    runtime = ac.registered_ops("AutocastCUDA")
    table = set(ac.cuda_policy_table())
    assert runtime - table == set(), "ops CUDA autocasts that the emulation would miss"
    # Dimname overloads are listed in autocast_mode.h but not registered without named-tensor builds.
    assert {op for op in table - runtime if "imname" not in op and "names_" not in op} == set()


@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        yield mode


def test_fp32_list_ops_run_in_fp32(fake: object) -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    ln = torch.nn.LayerNorm(8)
    with ac.cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.float32  # fp32_set_opt_dtype
        assert torch.log_softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # explicit dtype kept
        assert x.sum().dtype == torch.float32
        assert x.exp().dtype == torch.float32  # fp32
        assert ln(x).dtype == torch.float32
        assert x.norm().dtype == torch.float32  # fp32_append_dtype
        assert torch.addcmul(x, x, x.float()).dtype == torch.float32  # promote
        assert torch.cat([x, x.float()]).dtype == torch.float32  # CPU-only list entry passes through
        assert torch.nn.functional.linear(x.float(), torch.zeros(8, 8)).dtype == torch.bfloat16


def test_cpu_policy_is_restored_on_exit(fake: object) -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with ac.cuda_autocast_policy():
        pass
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.bfloat16  # CPU autocast keeps softmax in bf16


def test_weight_casts_are_cached_for_cuda_only_lower_precision_ops(fake: object) -> None:
    w = torch.nn.Parameter(torch.zeros(8, 8))
    x = torch.zeros(2, 8)
    with ac.cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = torch.einsum("ij,jk->ik", x, w)
        b = torch.einsum("ij,jk->ik", x, w)
        assert a.dtype == b.dtype == torch.bfloat16
