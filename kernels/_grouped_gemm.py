"""Many independent matmuls of different shapes in one kernel launch:
the checked wrapper and its torch reference.

Meant for many small per-feature or per-expert GEMMs, where a launch per matmul costs more than the math.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._common import (
    FLOAT_DTYPES,
    bad_input,
    check_same_device,
    check_same_dtype,
    check_tensor,
    choose_backend,
    tf32_allowed,
)


def grouped_gemm(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *, backend: str | None = None
) -> list[torch.Tensor]:
    """[a[i] @ b[i] for each group i], every product in one launch of a persistent, tile-scheduled kernel.

    a[i] is (m_i, k_i) and b[i] is (k_i, n_i); shapes differ freely between groups (any of them may
    be 0). Every tensor shares one dtype (float16, bfloat16 or float32; products summed in float32)
    and one device. Returns one (m_i, n_i) tensor per group, in a's dtype.

    backend: as for `attention` (None: Triton on CUDA, a loop of torch.matmul on CPU).
    """
    a, b = _check(a, b)
    if choose_backend(backend, a[0].device) == "torch":
        return grouped_gemm_reference(a, b)
    out = [x.new_empty((x.shape[0], y.shape[1])) for x, y in zip(a, b, strict=True)]
    _launch(a, b, out)
    return out


def _launch(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    from ._grouped_gemm_triton import launch  # triton is imported only on the Triton path

    launch(a, b, out, tf32=tf32_allowed())


def grouped_gemm_reference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The same as a loop of torch.matmul, one launch per group: the CPU serving path."""
    return [torch.matmul(x, y) for x, y in zip(a, b, strict=True)]


def _check(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if isinstance(a, torch.Tensor) or not isinstance(a, Sequence):
        raise bad_input("a", "a list of (m_i, k_i) tensors", type(a).__name__)
    if isinstance(b, torch.Tensor) or not isinstance(b, Sequence):
        raise bad_input("b", "a list of (k_i, n_i) tensors", type(b).__name__)
    if len(a) == 0:
        raise bad_input("a", "at least one (m_i, k_i) tensor", "an empty list")
    if len(b) != len(a):
        raise bad_input("b", f"{len(a)} tensors (k_i, n_i), one per tensor of a", f"{len(b)} tensors")
    first = check_tensor("a[0]", a[0], ndim=2, layout="(m_0, k_0)", dtypes=FLOAT_DTYPES)
    checked_a, checked_b = [], []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x = check_tensor(f"a[{i}]", x, ndim=2, layout=f"(m_{i}, k_{i})", dtypes=FLOAT_DTYPES)
        check_same_dtype(f"a[{i}]", x, "a[0]", first)
        check_same_device(f"a[{i}]", x, "a[0]", first)
        expected_b = f"(k_{i}={x.shape[1]}, n_{i})"
        y = check_tensor(f"b[{i}]", y, ndim=2, layout=expected_b, dtypes=FLOAT_DTYPES)
        check_same_dtype(f"b[{i}]", y, "a[0]", first)
        check_same_device(f"b[{i}]", y, "a[0]", first)
        if y.shape[0] != x.shape[1]:
            raise bad_input(f"b[{i}]", f"shape {expected_b} (k_{i} from a[{i}])", tuple(y.shape))
        checked_a.append(x)
        checked_b.append(y)
    return checked_a, checked_b
