"""WHERE a run happens: the GPU catalog and (lazily, with torch) local device detection."""

from trainfit.hardware.gpus import GPUSpec, get_gpu, list_gpus

__all__ = ["GPUSpec", "get_gpu", "list_gpus"]
