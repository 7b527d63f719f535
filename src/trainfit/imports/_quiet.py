"""The engines' own output, kept off stdout while their parsers read a user's file.

DeepSpeed makes its logger at import with a ``StreamHandler`` on whatever ``sys.stdout`` is at that moment
(deepspeed/utils/logging.py ``LoggerFactory.create_logger``, ``propagate = False``) and, on a machine without a
GPU, warns "Setting accelerator to CPU" through it as soon as anything asks for the accelerator
(deepspeed/accelerator/real_accelerator.py ``get_accelerator``): ``DeepSpeedConfig``, or transformers and accelerate
importing DeepSpeed. ``trainfit estimate --from ... --json`` promises stdout holds only the JSON, so every import of
a configuration runs inside :func:`library_output_to_stderr`: ``print`` and handlers made meanwhile write to stderr
(a library's handler made there keeps stderr afterwards), and handlers already writing to stdout are moved to
stderr for the duration.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def library_output_to_stderr() -> Iterator[None]:
    """Within: stdout is stderr, for ``print`` and for every logging ``StreamHandler`` on stdout (restored after)."""
    stdouts = {id(sys.stdout), id(sys.__stdout__)}
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    moved: list[tuple[logging.StreamHandler[Any], Any]] = [
        (h, h.stream)
        for lg in loggers
        if isinstance(lg, logging.Logger)
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and id(h.stream) in stdouts
    ]
    for handler, _ in moved:
        handler.setStream(sys.stderr)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)
