"""PYTORCH_CUDA_ALLOC_CONF parsing, checked against the grammar of c10/core/AllocatorConfig.cpp (parseArgs)."""

from __future__ import annotations

import pytest

from trainfit.allocator import AllocatorConfig, AllocatorConfigError, Backend, Simulator
from trainfit.errors import TrainfitError

MiB = 1 << 20


def test_defaults() -> None:
    for conf in (None, "", "   "):
        c = AllocatorConfig.parse(conf)
        assert c == AllocatorConfig()
        assert c.max_split_size_bytes is None
        assert not c.expandable_segments


def test_all_options() -> None:
    c = AllocatorConfig.parse(
        "max_split_size_mb:128, garbage_collection_threshold:0.6,expandable_segments:True,"
        "roundup_power2_divisions:8,max_non_split_rounding_mb:64,release_lock_on_cudamalloc:True,"
        "pinned_use_cuda_host_register:False,pinned_num_register_threads:4,backend:native"
    )
    assert c.max_split_size_bytes == 128 * MiB
    assert c.max_non_split_rounding_bytes == 64 * MiB
    assert c.garbage_collection_threshold == 0.6
    assert c.expandable_segments
    assert c.roundup_power2_divisions == (8,) * 16
    assert c.backend is Backend.NATIVE


def test_divisions_list() -> None:
    # 256 MiB -> interval 8: the first entry also fills 0..7; '>' fills the intervals after the last one named
    # (11 on), keeping 1024's 4 for 1-2 GiB requests: torch 2.13's AcceleratorAllocatorConfig::
    # parseRoundUpPower2Divisions (std::fill from last_index + 1; torch 2.13.0's libc10 parses this string to
    # 1 x9, 2, 4, 8 x5). torch <= 2.9's CUDAAllocatorConfig filled from last_index and gave 8 there.
    c = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert c.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) + (8,) * 5
    assert c.divisions_for(300 * MiB) == 1  # log2 = 28 -> index 8
    assert c.divisions_for(600 * MiB) == 2  # index 9
    assert c.divisions_for(1536 * MiB) == 4  # index 10: 1024's, not '>''s
    assert c.divisions_for(3 << 30) == 8  # index 11
    assert c.divisions_for(100 << 30) == 8  # clamped to 15


def test_divisions_list_edge_cases_as_torch_2_13_parses_them() -> None:
    # each string parsed by torch 2.13.0's libc10 (AcceleratorAllocatorConfig::parseArgs) for these vectors
    parse = AllocatorConfig.parse
    # '>' alone: last_index starts at 0, so interval 0 (1-2 MiB) keeps the default 0
    assert parse("roundup_power2_divisions:[>:4]").roundup_power2_divisions == (0,) + (4,) * 15
    # a key past 32 GiB is capped at interval 15, leaving '>' nothing to fill
    assert parse("roundup_power2_divisions:[65536:2,>:4]").roundup_power2_divisions == (2,) * 16
    # keys skipped between named ones keep 0; '>' starts after the last named key
    conf = "roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]"
    assert parse(conf).roundup_power2_divisions == (8,) * 8 + (16, 1, 0, 8) + (2,) * 4
    conf = "roundup_power2_divisions:[1:0,64:16,>:2]"
    assert parse(conf).roundup_power2_divisions == (0,) * 6 + (16,) + (2,) * 9


@pytest.mark.parametrize(
    "conf",
    [
        "roundup_power2_divisions:8",
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
        "roundup_power2_divisions:[1:0,64:16,>:2],max_split_size_mb:256,expandable_segments:True",
    ],
)
def test_to_env_reads_back_to_the_same_config(conf: str) -> None:
    """The string the planner exports (launch.sh, plan JSON) must be one PyTorch accepts and that means the same:
    parse(to_env(c)) == c, divisions lists included (they were once abbreviated to an unparsable ``[...]``)."""
    c = AllocatorConfig.parse(conf)
    text = c.to_env()
    assert "..." not in text
    assert AllocatorConfig.parse(text) == c


@pytest.mark.parametrize(
    "conf",
    [
        "max_split_size_mb:10",  # below 20
        "max_split_size_mb:abc",
        "garbage_collection_threshold:1.5",
        "expandable_segments:true",  # only True/False
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[256:3]",
        "unknown_option:1",
        "expandable_segments:True;max_split_size_mb:64",
        "max_split_size_mb",
        "backend:magic",
        "expandable_segments:True max_split_size_mb:64",
    ],
)
def test_bad_strings_raise_one_line(conf: str) -> None:
    with pytest.raises(AllocatorConfigError) as info:
        AllocatorConfig.parse(conf)
    assert isinstance(info.value, TrainfitError)
    assert "\n" not in str(info.value)


def test_async_backend_is_parsed_but_not_simulated() -> None:
    c = AllocatorConfig.parse("backend:cudaMallocAsync")
    assert c.backend is Backend.CUDA_MALLOC_ASYNC
    with pytest.raises(AllocatorConfigError):
        Simulator(c)
