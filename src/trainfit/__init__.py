"""trainfit: how much GPU memory a training run needs, where it goes, whether it fits.

The pinned public API (torch-free at import; a test asserts ``__all__``)::

    from trainfit import estimate, trace, load_model, get_gpu, Strategy, MemoryReport

    report = estimate(load_model("llama-3.1-8b"), Strategy(micro_batch=4), gpu=get_gpu("a100-sxm-80gb"))

``infer(model, InferenceSetup(...) or batch=..., prompt=..., gpu=...)`` answers inference memory
(:mod:`trainfit.infer`). ``trace`` is the :mod:`trainfit.trace` package, callable like its ``trace``
function (it imports torch only when called).
"""

from trainfit import trace
from trainfit.arch import load_model
from trainfit.errors import TrainfitError
from trainfit.estimate import estimate
from trainfit.hardware import get_gpu
from trainfit.infer import InferenceReport, infer
from trainfit.result import MemoryReport
from trainfit.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "InferenceReport",
    "MemoryReport",
    "Strategy",
    "TrainfitError",
    "__version__",
    "estimate",
    "get_gpu",
    "infer",
    "load_model",
    "trace",
]
