"""Triton kernels, each beside its torch reference; `backend=` picks the path per call.

The kernels (fused attention, paged decode attention, grouped GEMM) are their own issue.
"""
