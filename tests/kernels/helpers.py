"""The device and dtype grid the kernel tests share, their tolerances, and seeded input builders.

On CPU the kernels run under the Triton interpreter (`make test` sets TRITON_INTERPRET=1), which
computes bfloat16 wrongly, so bfloat16 runs only on a GPU; with a GPU every case also runs on CUDA.
"""

from __future__ import annotations

import pytest
import torch

NO_GPU = not torch.cuda.is_available()
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")]
BF16_GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(NO_GPU, reason="bf16 needs a GPU: the Triton interpreter computes bf16 wrongly"),
]

DEVICE_DTYPES = [
    pytest.param("cpu", torch.float16, id="cpu-fp16"),
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=GPU_ONLY),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=BF16_GPU_ONLY),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=GPU_ONLY),
]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU_ONLY)]
HEAD_DIMS = [16, 32, 64, 128]

# Against a float64 reference computed from the same (rounded) inputs, on outputs of order 1:
# float32 is near exact; half precision is limited by rounding the probabilities and the output.
# One number per dtype, used as both the absolute and the relative tolerance.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def random(
    *shape: int, dtype: torch.dtype, device: str, generator: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    """Standard normal values times `scale`, drawn on CPU from `generator` so every device sees the same."""
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(device, dtype)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`out` (in `dtype`) equals the float64 `expected` within that dtype's tolerance."""
    assert out.dtype == dtype and out.shape == expected.shape
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=tolerance, rtol=tolerance)


def as_float64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.double() for t in tensors]
