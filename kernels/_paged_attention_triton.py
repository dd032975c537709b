"""The paged decode attention kernel: one program per (sequence, key/value head),
all of its query heads at once.

The query heads that share a key/value head form the rows of one tile, so each cached key is read
once per group; key tiles gather their tokens through the block table, whatever the cache block size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_build import ConfigLists, TunedKernel, bucket

LOG2_E = math.log2(math.e)


def _paged_attention_fwd(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    context_lens_ptr,
    o_ptr,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_table,
    stride_os,
    stride_oh,
    stride_od,
    window,  # tokens seen, the newest included (no window: at least the longest context)
    qk_scale,  # the softmax scale times log2(e)
    context_bucket,  # autotune key only
    GROUP: tl.constexpr,  # query heads per key/value head
    GROUP_ROWS: tl.constexpr,  # GROUP rounded up to a tile height tl.dot accepts
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,  # tokens per cache block
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    member = tl.arange(0, GROUP_ROWS)
    head = kv_head * GROUP + member
    is_head = member < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_qs + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=is_head[:, None],
        other=0.0,
    )
    context_len = tl.load(context_lens_ptr + seq)
    table = block_table_ptr + seq * stride_table
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh

    row_max = tl.full([GROUP_ROWS], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([GROUP_ROWS], dtype=tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], dtype=tl.float32)

    # The window's first token; the tile holding it is the first read, and it sees that token,
    # so the row maximum is finite after it.
    lowest = tl.maximum(context_len - window, 0)
    for start in range((lowest // BLOCK_N) * BLOCK_N, context_len, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        in_context = (tokens < context_len) & (tokens >= lowest)
        cache_block = tl.load(table + tokens // CACHE_BLOCK, mask=in_context, other=0).to(tl.int64)
        slot = tokens % CACHE_BLOCK
        k = tl.load(
            k_base + cache_block[None, :] * stride_kb + slot[None, :] * stride_kt + dims[:, None] * stride_kd,
            mask=in_context[None, :],
            other=0.0,
        )
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(
            v_base + cache_block[:, None] * stride_vb + slot[:, None] * stride_vt + dims[None, :] * stride_vd,
            mask=in_context[:, None],
            other=0.0,
        )
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max

    # An empty context leaves row_sum at 0 and acc at 0: the answer is zeros, not 0/0.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        o_ptr + seq * stride_os + head[:, None] * stride_oh + dims[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=is_head[:, None],
    )


def _config(block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


CONFIGS = ConfigLists(
    hopper=[_config(128, 4, 3), _config(64, 4, 3), _config(64, 4, 2), _config(32, 4, 2), _config(128, 8, 3)],
    ampere=[_config(64, 4, 2), _config(32, 4, 2), _config(128, 4, 2), _config(64, 4, 3)],
    interpreter=_config(32, 4, 1),
)

PAGED_ATTENTION_FWD = TunedKernel(
    _paged_attention_fwd,
    configs=CONFIGS,
    # Tensor dtypes join the key on their own (the autotuner adds them).
    key=["context_bucket", "GROUP", "HEAD_DIM", "CACHE_BLOCK"],
    device_arg="q_ptr",
    do_not_specialize=["context_bucket"],
)


def launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    longest_context: int,
    window: int | None,
    scale: float,
    tf32: bool,
) -> None:
    """Fill `out` with paged decode attention; inputs were checked by the wrapper."""
    num_seqs, heads, head_dim = q.shape
    kv_heads, cache_block = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    precision = "tf32" if tf32 and q.dtype == torch.float32 else "ieee"

    def grid(meta: dict[str, Any]) -> tuple[int, ...]:
        return (num_seqs, kv_heads)

    PAGED_ATTENTION_FWD[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        out,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_table.stride(0),
        *out.stride(),
        window if window is not None else max(longest_context, 1),
        scale * LOG2_E,
        bucket(longest_context),
        group,
        max(16, triton.next_power_of_2(group)),
        head_dim,
        cache_block,
        precision,
    )
