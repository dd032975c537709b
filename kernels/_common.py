"""What the kernel wrappers share: their errors, the choice of backend per call, and input checks.

Nothing here imports triton: the torch references must serve on machines without it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Literal

import torch

from ipnext.errors import KernelBackendError, KernelInputError

Backend = Literal["triton", "torch"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)


def interpreter_on() -> bool:
    """Whether the caller allowed the Triton interpreter (TRITON_INTERPRET=1), the only way to run on CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_backend(backend: str | None, device: torch.device) -> Backend:
    """The path one call takes: None means Triton on CUDA and the torch reference anywhere else.

    "triton" is checked here, so a call that cannot run the kernel fails before any work is done.
    """
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return "torch"
    if backend != "triton":
        raise KernelInputError(
            f"backend: expected None, 'triton' or 'torch', got {backend!r}.",
            field="backend",
            value=backend,
            fix="pass backend=None to pick by device.",
        )
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise KernelBackendError(
            f"backend='triton' needs the triton package, which cannot be imported ({exc}).",
            fix="install triton, or pass backend='torch'.",
        ) from exc
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpreter_on():
        return "triton"
    raise KernelBackendError(
        f"backend='triton' runs on CUDA tensors, or on CPU tensors under the Triton interpreter; "
        f"got {device.type} tensors with TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', 'unset')}.",
        fix="move the tensors to a GPU, set TRITON_INTERPRET=1 to interpret on CPU, or pass backend='torch'.",
    )


def bad_input(field: str, expected: str, got: object, fix: str | None = None) -> KernelInputError:
    """The error for one bad argument; the message starts with the argument's name."""
    return KernelInputError(f"{field}: expected {expected}, got {got}.", field=field, value=got, fix=fix)


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int,
    layout: str,
    dtypes: Sequence[torch.dtype],
) -> torch.Tensor:
    """`tensor` is a torch.Tensor with `ndim` dimensions (named in `layout`) and one of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise bad_input(name, f"a torch.Tensor of shape {layout}", type(tensor).__name__)
    if tensor.dim() != ndim:
        raise bad_input(name, f"shape {layout} ({ndim} dimensions)", tuple(tensor.shape))
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise bad_input(name, f"dtype {names} for shape {layout}", tensor.dtype)
    return tensor


def check_same_dtype(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if tensor.dtype != reference.dtype:
        raise bad_input(name, f"dtype {reference.dtype} (the dtype of {reference_name})", tensor.dtype)


def check_same_device(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if tensor.device != reference.device:
        raise bad_input(name, f"device {reference.device} (the device of {reference_name})", tensor.device)


def check_head_dim(name: str, head_dim: int, layout: str) -> None:
    if head_dim not in HEAD_DIMS:
        raise bad_input(
            name,
            f"shape {layout} with head_dim one of {', '.join(map(str, HEAD_DIMS))}",
            f"head_dim {head_dim}",
        )


def check_heads(name: str, heads: int, kv_heads: int, layout: str) -> int:
    """Query heads per key/value head; grouped-query attention needs heads to be a multiple of kv_heads."""
    if kv_heads < 1 or heads % kv_heads != 0:
        raise bad_input(
            name,
            f"shape {layout} with kv_heads dividing the {heads} query heads",
            f"kv_heads {kv_heads}",
        )
    return heads // kv_heads


def default_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return float(head_dim) ** -0.5
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise bad_input("scale", "a float (or None for 1/sqrt(head_dim))", repr(scale))
    return float(scale)


def tf32_allowed() -> bool:
    """float32 inputs multiply in TF32 only where torch would,
    so the kernels match torch.matmul's precision."""
    return torch.get_float32_matmul_precision() != "highest"
