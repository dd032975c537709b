"""Forward attention with an online softmax (FlashAttention style):
the checked wrapper and its torch reference.

Covers self-attention, prefill over a cached prefix and decode (n_q <= n_kv, the causal mask aligned to
the end), a sliding window on top of the causal mask, and grouped-query attention (heads a multiple of
kv_heads).
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    bad_input,
    check_head_dim,
    check_heads,
    check_same_device,
    check_same_dtype,
    check_tensor,
    choose_backend,
    default_scale,
    tf32_allowed,
)

Q_LAYOUT = "(batch, heads, n_q, head_dim)"
KV_LAYOUT = "(batch, kv_heads, n_kv, head_dim)"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v per head, in one fused kernel that never stores the n_q x n_kv scores.

    q is (batch, heads, n_q, head_dim); k and v are (batch, kv_heads, n_kv, head_dim) with heads a
    multiple of kv_heads (query head h reads key/value head h // (heads // kv_heads)). With `causal`,
    query i sees keys 0 .. n_kv - n_q + i, so n_q < n_kv is prefill over a cached prefix and n_q = 1
    is decode; causal needs n_q <= n_kv. `window` (causal only) narrows that to the `window` keys
    ending at the query's own: keys n_kv - n_q + i - window + 1 .. n_kv - n_q + i.
    head_dim is 16, 32, 64 or 128; dtype float16, bfloat16 or
    float32 (products and sums in float32); `scale` defaults to 1/sqrt(head_dim). Returns a tensor of
    q's shape and dtype.

    backend: None runs Triton on CUDA tensors and the torch reference on CPU tensors; "triton" forces
    the kernel (on CPU only under TRITON_INTERPRET=1) and raises KernelBackendError where it cannot
    run; "torch" forces the reference. Bad input raises KernelInputError (a ValueError) naming the
    argument.
    """
    q, k, v = _check(q, k, v, causal, window)
    head_dim = q.shape[3]
    scale = default_scale(scale, head_dim)
    if choose_backend(backend, q.device) == "torch":
        return attention_reference(q, k, v, causal=causal, window=window, scale=scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    _launch(q, k, v, out, causal=causal, window=window, scale=scale)
    return out


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    scale: float,
) -> None:
    from ._attention_triton import launch  # triton is imported only on the Triton path

    launch(q, k, v, out, causal=causal, window=window, scale=scale, tf32=tf32_allowed())


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same attention by explicit math, in float32 (float64 stays float64): the CPU serving path.

    Takes inputs as `attention` accepts them (not checked here), in any floating dtype.
    """
    heads, n_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    n_kv = k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    group = heads // k.shape[1]
    keys = k.to(compute).repeat_interleave(group, dim=1)
    values = v.to(compute).repeat_interleave(group, dim=1)
    scores = q.to(compute) @ keys.transpose(-2, -1) * scale
    if causal:
        # Aligned to the end: the last query sees every key.
        visible = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril(diagonal=n_kv - n_q)
        if window is not None:  # and no further back than the window
            visible &= ~torch.ones_like(visible).tril(diagonal=n_kv - n_q - window)
        scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = check_tensor("q", q, ndim=4, layout=Q_LAYOUT, dtypes=FLOAT_DTYPES)
    batch, heads, n_q, head_dim = q.shape
    check_head_dim("q", head_dim, Q_LAYOUT)
    k = check_tensor("k", k, ndim=4, layout=KV_LAYOUT, dtypes=FLOAT_DTYPES)
    check_same_dtype("k", k, "q", q)
    check_same_device("k", k, "q", q)
    kv_heads, n_kv = k.shape[1], k.shape[2]
    expected_kv = f"(batch={batch}, kv_heads, n_kv, head_dim={head_dim})"
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise bad_input("k", f"shape {expected_kv}", tuple(k.shape))
    check_heads("k", heads, kv_heads, expected_kv)
    if n_kv < 1:
        raise bad_input("k", f"shape {expected_kv} with n_kv >= 1", tuple(k.shape))
    v = check_tensor("v", v, ndim=4, layout=KV_LAYOUT, dtypes=FLOAT_DTYPES)
    check_same_dtype("v", v, "q", q)
    check_same_device("v", v, "q", q)
    if v.shape != k.shape:
        raise bad_input("v", f"shape {tuple(k.shape)} (the shape of k)", tuple(v.shape))
    if not isinstance(causal, bool):
        raise bad_input("causal", "True or False", repr(causal))
    if causal and n_q > n_kv:
        raise bad_input(
            "q",
            f"shape {Q_LAYOUT} with n_q <= n_kv={n_kv} for causal attention (the mask is aligned to the end)",
            tuple(q.shape),
        )
    if window is not None and (
        not causal or isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise bad_input("window", "None, or an integer >= 1 with causal=True", repr(window))
    return q, k, v
