"""The grouped GEMM kernel against a float64 loop of matmuls: groups of different shapes in one launch,
a one-row group, odd k and n, empty groups, transposed operands."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipnext.kernels import grouped_gemm, grouped_gemm_reference
from tests.kernels.helpers import DEVICE_DTYPES, as_float64, assert_matches, random

pytestmark = pytest.mark.timeout(120)  # first calls on a GPU compile and autotune

# (m, k, n) per group.
GROUP_SETS = {
    # A one-row group, odd k and n, a group smaller than a tile and one spanning several.
    "mixed": [(1, 40, 33), (64, 17, 96), (37, 70, 5), (50, 50, 50)],
    # More tiles than the interpreter's programs, so each program walks tiles of several groups.
    "many-small": [
        (m, k, n) for m, k, n in zip(range(3, 40, 3), range(40, 1, -3), range(5, 70, 5), strict=True)
    ],
    # Row-major, k and n multiples of 16 bytes: the kernel's aligned path (vectorized loads).
    "aligned": [(1, 64, 32), (45, 16, 48), (70, 128, 8), (33, 40, 24)],
    # Groups with no rows, no columns, or nothing to sum over (zeros) between real ones.
    "with-empty": [(0, 8, 8), (9, 0, 7), (5, 11, 0), (33, 9, 31)],
}


def operands(
    shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rng = torch.Generator().manual_seed(len(shapes))
    # a scaled by 1/sqrt(k) keeps the products of order 1, where the tolerances are set.
    a = [
        random(m, k, dtype=dtype, device=device, generator=rng, scale=max(k, 1) ** -0.5) for m, k, _ in shapes
    ]
    b = [random(k, n, dtype=dtype, device=device, generator=rng) for _, k, n in shapes]
    return a, b


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("groups", GROUP_SETS)
def test_triton_grouped_gemm_matches_a_float64_loop(groups: str, device: str, dtype: torch.dtype) -> None:
    a, b = operands(GROUP_SETS[groups], dtype, device)
    out = grouped_gemm(a, b, backend="triton")
    expected = grouped_gemm_reference(as_float64(*a), as_float64(*b))
    assert len(out) == len(expected)
    for got, want in zip(out, expected, strict=True):
        assert_matches(got, want, dtype)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_triton_grouped_gemm_reads_transposed_and_sliced_operands(device: str, dtype: torch.dtype) -> None:
    a, b = operands([(20, 48, 36), (7, 33, 65)], dtype, device)
    a_t = a[0].t().contiguous().t()  # column-major
    b_t = b[1].t().contiguous().t()
    sliced = a[1][:, 1:]  # a row stride that is not its width
    b_sliced = b[1][1:]
    out = grouped_gemm([a_t, sliced], [b[0], b_t[1:]], backend="triton")
    expected = grouped_gemm_reference(as_float64(a[0], sliced), as_float64(b[0], b_sliced))
    for got, want in zip(out, expected, strict=True):
        assert_matches(got, want, dtype)


@settings(deadline=None, derandomize=True, max_examples=12, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 70), st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=6
    )
)
def test_any_group_shapes_match_a_loop_of_matmuls(shapes: list[tuple[int, int, int]]) -> None:
    a, b = operands(shapes, torch.float32, "cpu")
    out = grouped_gemm(a, b, backend="triton")
    for got, want in zip(out, grouped_gemm_reference(as_float64(*a), as_float64(*b)), strict=True):
        assert_matches(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_aligned_path_is_taken_only_when_every_group_allows_it(dtype: torch.dtype) -> None:
    from ipnext.kernels._grouped_gemm_triton import alignment

    def outputs(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x.new_empty(x.shape[0], y.shape[1]) for x, y in zip(a, b, strict=True)]

    a, b = operands(GROUP_SETS["aligned"], dtype, "cpu")
    assert alignment(a, b, outputs(a, b)) == 16 // a[0].element_size()
    transposed = [b[0].t().contiguous().t(), *b[1:]]
    assert alignment(a, transposed, outputs(a, transposed)) == 0
    a, b = operands(GROUP_SETS["mixed"], dtype, "cpu")
    assert alignment(a, b, outputs(a, b)) == 0
