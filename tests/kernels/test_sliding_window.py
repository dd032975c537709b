"""Sliding-window attention (Mistral, Qwen2): both kernels against their float64 references, and the
references against plain masked math; a query sees its own key and the window - 1 before it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ipnext.kernels import (
    KernelInputError,
    attention,
    attention_reference,
    paged_attention,
    paged_attention_reference,
)
from tests.kernels.helpers import DEVICE_DTYPES, as_float64, assert_matches, random
from tests.kernels.test_attention import qkv
from tests.kernels.test_paged_attention import CONTEXT_LENS, paged_inputs

pytestmark = pytest.mark.timeout(120)

# (heads, kv_heads, n_q, n_kv, window): windows inside one 32-wide interpreter tile, across tiles,
# wider than the context (no effect), one key (the query's own), prefill over a cache, decode.
CASES = {
    "self-window-5": (2, 2, 45, 45, 5),
    "self-window-40-gqa": (4, 2, 70, 70, 40),
    "window-wider-than-context": (2, 1, 33, 33, 100),
    "window-of-one": (2, 2, 20, 20, 1),
    "prefill-over-cache": (4, 2, 19, 81, 30),
    "decode": (4, 1, 1, 77, 9),
}


def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """The window by plain math: query i (at absolute n_kv - n_q + i) sees keys j with 0 <= i - j < window."""
    n_q, n_kv = q.shape[2], k.shape[2]
    gap = (torch.arange(n_q)[:, None] + n_kv - n_q) - torch.arange(n_kv)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < window), enable_gqa=True)


@pytest.mark.parametrize("case", CASES)
def test_the_reference_window_is_the_masked_math(case: str) -> None:
    heads, kv_heads, n_q, n_kv, window = CASES[case]
    q, k, v = as_float64(*qkv(1, heads, kv_heads, n_q, n_kv, 16, torch.float64, "cpu"))
    torch.testing.assert_close(
        attention_reference(q, k, v, causal=True, window=window), masked(q, k, v, window)
    )


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_triton_attention_with_a_window_matches_the_reference(
    case: str, device: str, dtype: torch.dtype
) -> None:
    heads, kv_heads, n_q, n_kv, window = CASES[case]
    q, k, v = qkv(2, heads, kv_heads, n_q, n_kv, 32, dtype, device)
    out = attention(q, k, v, causal=True, window=window, backend="triton")
    assert_matches(out, attention_reference(*as_float64(q, k, v), causal=True, window=window), dtype)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 33, 1000])
def test_triton_paged_attention_with_a_window_matches_the_reference(
    window: int, device: str, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, table, lens = paged_inputs(4, 2, 16, 32, dtype, device, seed=window)
    out = paged_attention(q, k_cache, v_cache, table, lens, window=window, backend="triton")
    q64, k64, v64 = as_float64(q, k_cache, v_cache)
    assert_matches(out, paged_attention_reference(q64, k64, v64, table, lens, window=window), dtype)


def test_the_paged_reference_window_is_dense_decode_over_the_last_keys() -> None:
    window = 10
    q, k_cache, v_cache, table, lens = paged_inputs(4, 2, 8, 16, torch.float64, "cpu", seed=3)
    out = paged_attention_reference(q, k_cache, v_cache, table, lens, window=window)
    for seq, length in enumerate(CONTEXT_LENS):
        if length == 0:
            assert torch.equal(out[seq], torch.zeros_like(out[seq]))
            continue
        blocks = table[seq, : -(-length // 8)].long()
        keys = k_cache[blocks].transpose(0, 1).reshape(2, -1, 16)[:, :length]
        values = v_cache[blocks].transpose(0, 1).reshape(2, -1, 16)[:, :length]
        lo = max(0, length - window)
        expected = attention_reference(q[seq][None, :, None], keys[None, :, lo:], values[None, :, lo:])
        torch.testing.assert_close(out[seq], expected[0, :, 0])


def test_a_window_needs_causal_attention_and_a_positive_size() -> None:
    q, k, v = (
        random(1, 2, 4, 16, dtype=torch.float32, device="cpu", generator=torch.Generator().manual_seed(0)),
        *(
            random(1, 2, 4, 16, dtype=torch.float32, device="cpu", generator=torch.Generator().manual_seed(i))
            for i in (1, 2)
        ),
    )
    with pytest.raises(KernelInputError, match=r"^window"):
        attention(q, k, v, causal=False, window=3)
    with pytest.raises(KernelInputError, match=r"^window"):
        attention(q, k, v, causal=True, window=0)
    paged = paged_inputs(4, 2, 16, 32, torch.float32, "cpu")
    with pytest.raises(KernelInputError, match=r"^window"):
        paged_attention(*paged, window=-1)
