"""trainfit: how much GPU memory a training run needs, where every byte goes, and whether it fits.

The public API is small and torch-free: importing ``trainfit`` never imports torch, transformers or
huggingface_hub. Heavy machinery (tracing, measuring, the training step) lives in subpackages that
import torch lazily.
"""

from trainfit.errors import TrainfitError

__version__ = "0.1.0"

__all__ = ["TrainfitError", "__version__"]
