"""Triton kernels for serving, each beside its torch reference; `backend=` picks the path per call.

`attention` (fused forward attention with an online softmax, causal or not, grouped-query),
`paged_attention` (decode over a paged key/value cache) and `grouped_gemm` (many matmuls of
different shapes in one launch). With backend=None, CUDA tensors run the Triton kernel and CPU
tensors the torch reference, so CPU serving never runs interpreted, except float32 paged_attention on
CPU, which runs a C kernel compiled for the host (the reference where none builds);
backend="triton" forces the
kernel (on CPU only under TRITON_INTERPRET=1) and raises KernelBackendError where it cannot run;
backend="torch" forces the reference. Bad input raises KernelInputError, a ValueError whose message
starts with the argument's name. triton itself is imported only when a kernel first runs.
"""

from ipnext.errors import KernelBackendError, KernelInputError

from ._attention import attention, attention_reference
from ._grouped_gemm import grouped_gemm, grouped_gemm_reference
from ._paged_attention import paged_attention, paged_attention_reference

__all__ = [
    "KernelBackendError",
    "KernelInputError",
    "attention",
    "attention_reference",
    "grouped_gemm",
    "grouped_gemm_reference",
    "paged_attention",
    "paged_attention_reference",
]
