"""A torch-free model of PyTorch's CUDA caching allocator, to predict reserved memory.

* :mod:`.config` — ``PYTORCH_CUDA_ALLOC_CONF`` parsed into a typed :class:`AllocatorConfig`;
* :mod:`.simulator` — the event-driven model (:func:`simulate`, :class:`Simulator`);
* :mod:`.replay` — replay of a real ``torch.cuda.memory._snapshot()`` (:func:`replay_snapshot`);
* :mod:`.workspaces` — the cuBLAS/cuBLASLt workspaces, allocations of the same allocator;
* :mod:`.process` — several runs in one process: what the workspaces pin between them.

See ``docs/allocator.md`` for the rules, their sources and the measured agreement.
"""

from trainfit.allocator.config import AllocatorConfig, AllocatorConfigError, Backend
from trainfit.allocator.replay import ReplayResult, config_of, replay_snapshot
from trainfit.allocator.simulator import (
    AllocatorResult,
    BlockLayout,
    BlockState,
    Event,
    Op,
    OutOfMemory,
    PoolKind,
    SegmentLayout,
    Simulator,
    allocation_size,
    least_capacity,
    round_size,
    simulate,
)

__all__ = [
    "AllocatorConfig",
    "AllocatorConfigError",
    "AllocatorResult",
    "Backend",
    "BlockLayout",
    "BlockState",
    "Event",
    "Op",
    "OutOfMemory",
    "PoolKind",
    "ReplayResult",
    "SegmentLayout",
    "Simulator",
    "allocation_size",
    "config_of",
    "least_capacity",
    "replay_snapshot",
    "round_size",
    "simulate",
]
