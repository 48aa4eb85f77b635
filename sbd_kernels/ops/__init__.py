"""The `sbd` op families. Each folder holds the public wrapper and fake kernel (`__init__.py`), the
Triton GPU kernels (`triton.py`) and the pure-PyTorch oracle (`naive.py`). `trusted_values()` lets a caller
that validated its lengths and settings skip the per-call value checks (`_trusted.py`)."""
from sbd_kernels.ops._trusted import trusted_values
from sbd_kernels.ops.attention import block_attention_with_kvcache
from sbd_kernels.ops.sampling import entropy_sample
from sbd_kernels.ops.scatter import mask_scatter_

__all__ = ["block_attention_with_kvcache", "entropy_sample", "mask_scatter_", "trusted_values"]
