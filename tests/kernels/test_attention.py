"""The fused attention kernel against a float64 reference: odd lengths, decode, prefill over a cache, GQA,
causal and not, every head_dim; and the reference itself against PyTorch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipnext.kernels import attention, attention_reference
from tests.kernels.helpers import DEVICE_DTYPES, DEVICES, HEAD_DIMS, as_float64, assert_matches, random

pytestmark = pytest.mark.timeout(120)  # first calls on a GPU compile and autotune

# (batch, heads, kv_heads, n_q, n_kv, causal); lengths straddle the interpreter's 32-wide tiles.
CASES = {
    "causal-odd-length": (2, 2, 2, 45, 45, True),
    "full-gqa-fewer-queries": (1, 4, 2, 45, 70, False),
    "decode-one-query-mqa": (1, 4, 1, 1, 77, True),
    "prefill-over-cache-gqa": (1, 4, 2, 19, 81, True),  # shift 62: a causal band edge inside a tile
    "more-queries-than-keys": (1, 2, 2, 40, 23, False),
    "three-heads-per-kv-head": (1, 6, 2, 33, 33, True),
}


def qkv(
    batch: int, heads: int, kv_heads: int, n_q: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(n_q * 1000 + n_kv + head_dim)
    return (
        random(batch, heads, n_q, head_dim, dtype=dtype, device=device, generator=rng),
        random(batch, kv_heads, n_kv, head_dim, dtype=dtype, device=device, generator=rng),
        random(batch, kv_heads, n_kv, head_dim, dtype=dtype, device=device, generator=rng),
    )


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", CASES)
def test_triton_attention_matches_the_float64_reference(
    case: str, head_dim: int, device: str, dtype: torch.dtype
) -> None:
    batch, heads, kv_heads, n_q, n_kv, causal = CASES[case]
    q, k, v = qkv(batch, heads, kv_heads, n_q, n_kv, head_dim, dtype, device)
    out = attention(q, k, v, causal=causal, backend="triton")
    assert_matches(out, attention_reference(*as_float64(q, k, v), causal=causal), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_attention_reads_strided_inputs_and_takes_a_scale(device: str) -> None:
    # Projections usually come out as (batch, n, heads, head_dim); the kernel reads them in place.
    rng = torch.Generator().manual_seed(7)
    q = random(2, 33, 4, 32, dtype=torch.float32, device=device, generator=rng).transpose(1, 2)
    k = random(2, 50, 2, 32, dtype=torch.float32, device=device, generator=rng).transpose(1, 2)
    v = random(2, 50, 2, 32, dtype=torch.float32, device=device, generator=rng).transpose(1, 2)
    out = attention(q, k, v, causal=True, scale=0.3, backend="triton")
    assert out.is_contiguous()
    assert_matches(out, attention_reference(*as_float64(q, k, v), causal=True, scale=0.3), torch.float32)


def test_attention_with_no_queries_is_empty() -> None:
    q, k, v = qkv(1, 2, 2, 0, 5, 16, torch.float32, "cpu")
    assert attention(q, k, v, backend="triton").shape == (1, 2, 0, 16)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa_for_self_attention_with_gqa(causal: bool) -> None:
    q, k, v = as_float64(*qkv(2, 4, 2, 21, 21, 16, torch.float64, "cpu"))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(attention_reference(q, k, v, causal=causal), expected)


def test_reference_prefill_over_a_cache_is_the_tail_of_full_causal_attention() -> None:
    # The end-aligned mask: the last n_q queries of a causal pass see exactly what prefill gives them.
    q, k, v = qkv(1, 2, 1, 30, 30, 16, torch.float64, "cpu")
    full = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(attention_reference(q[:, :, -7:], k, v, causal=True), full[:, :, -7:])
    torch.testing.assert_close(attention_reference(q[:, :, -1:], k, v, causal=True), full[:, :, -1:])
    # Decode with n_q = 1 sees every key, causal or not.
    torch.testing.assert_close(attention_reference(q[:, :, -1:], k, v), full[:, :, -1:])


@settings(deadline=None, derandomize=True, max_examples=12, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_kv=st.integers(1, 100),
    query_share=st.floats(0.0, 1.0),
    causal=st.booleans(),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
)
def test_any_lengths_match_the_reference(
    n_kv: int, query_share: float, causal: bool, kv_heads: int, group: int
) -> None:
    n_q = max(1, round(query_share * n_kv))  # 1 .. n_kv queries: decode up to self-attention
    q, k, v = qkv(1, kv_heads * group, kv_heads, n_q, n_kv, 32, torch.float32, "cpu")
    out = attention(q, k, v, causal=causal, backend="triton")
    assert_matches(out, attention_reference(*as_float64(q, k, v), causal=causal), torch.float32)
