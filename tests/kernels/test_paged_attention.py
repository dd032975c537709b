"""Paged decode attention against a float64 reference: ragged context lengths, shuffled block tables, GQA,
an empty context; and the reference itself against dense attention."""

from __future__ import annotations

import pytest
import torch

from ipnext.kernels import attention_reference, paged_attention, paged_attention_reference
from tests.kernels.helpers import DEVICE_DTYPES, DEVICES, HEAD_DIMS, as_float64, assert_matches, random

pytestmark = pytest.mark.timeout(120)  # first calls on a GPU compile and autotune

# (heads, kv_heads, block_size): grouped-query, multi-head, multi-query, and a group of 24 heads,
# taller than one 16-row tile and not a power of two.
LAYOUTS = {
    "gqa-block16": (4, 2, 16),
    "mha-block8": (2, 2, 8),
    "mqa-block32": (8, 1, 32),
    "group-of-24-block16": (48, 2, 16),
}
# Ragged, with an empty context, one token, and lengths on and off block boundaries.
CONTEXT_LENS = [37, 1, 0, 70, 16]


def paged_inputs(
    heads: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q, caches and a shuffled block table;
    table entries past each context are -1, which must never be read."""
    rng = torch.Generator().manual_seed(seed)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    max_blocks = -(-max(CONTEXT_LENS) // block_size) + 1
    needed = [-(-n // block_size) for n in CONTEXT_LENS]
    num_blocks = sum(needed) + 3  # a few blocks nobody uses
    shuffled = torch.randperm(num_blocks, generator=rng).tolist()
    table = torch.full((len(CONTEXT_LENS), max_blocks), -1, dtype=torch.int32)
    for seq, count in enumerate(needed):
        table[seq, :count] = torch.tensor([shuffled.pop() for _ in range(count)], dtype=torch.int32)
    q = random(len(CONTEXT_LENS), heads, head_dim, dtype=dtype, device=device, generator=rng)
    k_cache = random(num_blocks, kv_heads, block_size, head_dim, dtype=dtype, device=device, generator=rng)
    v_cache = random(num_blocks, kv_heads, block_size, head_dim, dtype=dtype, device=device, generator=rng)
    return q, k_cache, v_cache, table.to(device), lens.to(device)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_paged_attention_matches_the_float64_reference(
    layout: str, head_dim: int, device: str, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, table, lens = paged_inputs(*LAYOUTS[layout], head_dim, dtype, device)
    out = paged_attention(q, k_cache, v_cache, table, lens, backend="triton")
    q64, k64, v64 = as_float64(q, k_cache, v_cache)
    expected = paged_attention_reference(q64, k64, v64, table, lens)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_context_gives_zeros(device: str) -> None:
    q, k_cache, v_cache, table, lens = paged_inputs(4, 2, 16, 32, torch.float32, device)
    empty = CONTEXT_LENS.index(0)
    for backend in ("triton", "torch"):
        out = paged_attention(q, k_cache, v_cache, table, lens, backend=backend)
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        assert out[empty - 1].abs().sum() > 0  # its neighbours are answered


def test_reference_equals_dense_attention_over_the_gathered_context() -> None:
    """Every sequence (empty, one token, on and off block boundaries), each token written out
    one at a time from the table."""
    q, k_cache, v_cache, table, lens = paged_inputs(4, 2, 8, 16, torch.float64, "cpu")
    out = paged_attention_reference(q, k_cache, v_cache, table, lens)
    for seq, length in enumerate(CONTEXT_LENS):
        if length == 0:
            assert torch.equal(out[seq], torch.zeros_like(out[seq]))
            continue
        keys = torch.stack([k_cache[table[seq, t // 8], :, t % 8] for t in range(length)], dim=1)
        values = torch.stack([v_cache[table[seq, t // 8], :, t % 8] for t in range(length)], dim=1)
        dense = attention_reference(q[seq][None, :, None], keys[None], values[None])
        torch.testing.assert_close(out[seq], dense[0, :, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_computes_in_float32_and_answers_in_the_inputs_dtype(dtype: torch.dtype) -> None:
    q, k_cache, v_cache, table, lens = paged_inputs(8, 2, 16, 32, dtype, "cpu", seed=5)
    out = paged_attention_reference(q, k_cache, v_cache, table, lens)
    q64, k64, v64 = as_float64(q, k_cache, v_cache)
    assert out.dtype == dtype
    assert_matches(out, paged_attention_reference(q64, k64, v64, table, lens), dtype)
