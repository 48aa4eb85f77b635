"""sbd_kernels: fused kernels for Set Block Decoding, exposed as `torch.ops.sbd.*`.

Importing the package loads the compiled operator library (schemas + C++ CPU kernels) and registers the
Triton kernels for CUDA tensors and the fake kernels used by `torch.compile`.
"""
from sbd_kernels._loader import SbdLibraryLoadError, load_extension

load_extension()

from sbd_kernels import ops
from sbd_kernels.ops import block_attention_with_kvcache, entropy_sample, mask_scatter_

__version__ = "0.1.0"
__all__ = [
    "SbdLibraryLoadError",
    "block_attention_with_kvcache",
    "entropy_sample",
    "mask_scatter_",
    "ops",
]
