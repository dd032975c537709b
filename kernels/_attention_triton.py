"""The fused attention forward kernel: one program per (query tile, batch x head),
online softmax over key tiles.

Scores live only as one BLOCK_M x BLOCK_N tile in registers; the running row maximum and row sum
rescale the float32 accumulator as each key tile arrives, so no n_q x n_kv matrix is ever stored.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_build import ConfigLists, TunedKernel, bucket

LOG2_E = math.log2(math.e)


def _attention_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    heads,
    n_q,
    n_kv,
    window,  # keys seen behind a query, its own included (HAS_WINDOW only)
    qk_scale,  # the softmax scale times log2(e): the kernel works in powers of two
    n_q_bucket,  # autotune key only
    n_kv_bucket,  # autotune key only
    GROUP: tl.constexpr,  # query heads per key/value head
    HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # causal with a sliding window: every tile is masked, from the window's start
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = (batch_head // heads).to(tl.int64)
    head = (batch_head % heads).to(tl.int64)
    kv_head = head // GROUP

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_tile = q_ptr + batch * stride_qb + head * stride_qh
    q = tl.load(
        q_tile + rows[:, None] * stride_qm + dims[None, :] * stride_qd, mask=rows[:, None] < n_q, other=0.0
    )
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Query row r sees keys 0 .. r + shift (causal, aligned to the end) or all n_kv keys.
    # Keys below `open_end` are seen by every row of this tile and need no mask; the tiles from
    # there to `end` are masked. Without a window every row sees key 0, so a row's maximum is
    # finite after tile one.
    if IS_CAUSAL:
        shift = n_kv - n_q
        open_end = tl.minimum(tile_m * BLOCK_M + shift + 1, n_kv)
        end = tl.minimum((tile_m + 1) * BLOCK_M + shift, n_kv)
    else:
        shift = 0
        open_end = n_kv
        end = n_kv
    open_end = (open_end // BLOCK_N) * BLOCK_N
    first = open_end  # where the masked tiles start
    if HAS_WINDOW:
        # Every tile is masked, from the lowest key the tile's first row sees; none below it is
        # read. A row may see no key of a tile, so the maximum can stay -inf for a while.
        open_end = 0
        first = tl.maximum(tile_m * BLOCK_M + shift - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N

    for start in range(0, open_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + cols[None, :] * stride_kn + dims[:, None] * stride_kd)
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :] * stride_vd)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max

    for start in range(first, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_range = cols < n_kv
        k = tl.load(
            k_base + cols[None, :] * stride_kn + dims[:, None] * stride_kd, mask=in_range[None, :], other=0.0
        )
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        visible = in_range[None, :]
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + shift)
        if HAS_WINDOW:
            visible = visible & (cols[None, :] > rows[:, None] + shift - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # With a window a row may have seen no key yet (its maximum still -inf): exponents are
        # taken against a finite stand-in, so they come out 0, never -inf - -inf.
        base = new_max
        if HAS_WINDOW:
            base = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - base[:, None])
        rescale = tl.exp2(row_max - base)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + dims[None, :] * stride_vd, mask=in_range[:, None], other=0.0
        )
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max

    if HAS_WINDOW:  # padding rows past n_q may see no key: 0, not 0/0 (they are never stored)
        row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / row_sum[:, None]
    o_tile = o_ptr + batch * stride_ob + head * stride_oh
    tl.store(
        o_tile + rows[:, None] * stride_om + dims[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=rows[:, None] < n_q,
    )


def _config(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


CONFIGS = ConfigLists(
    hopper=[
        _config(128, 128, 8, 3),
        _config(128, 64, 8, 3),
        _config(128, 64, 4, 3),
        _config(64, 64, 4, 3),
        _config(64, 128, 4, 3),
        _config(16, 64, 4, 3),  # decode and short prefill
        _config(16, 128, 4, 3),
    ],
    ampere=[
        _config(128, 64, 4, 3),
        _config(128, 32, 4, 3),
        _config(64, 64, 4, 3),
        _config(64, 32, 4, 2),
        _config(16, 64, 4, 2),  # decode and short prefill
        _config(16, 32, 4, 2),
    ],
    interpreter=_config(32, 32, 4, 1),
)


def _fits(config: triton.Config, args: dict[str, Any]) -> bool:
    """A query tile much taller than the queries only wastes work (decode has one query row)."""
    return bool(config.kwargs["BLOCK_M"] <= max(16, args["n_q_bucket"]))


ATTENTION_FWD = TunedKernel(
    _attention_fwd,
    configs=CONFIGS,
    # Tensor dtypes join the key on their own (the autotuner adds them).
    key=["n_q_bucket", "n_kv_bucket", "HEAD_DIM", "IS_CAUSAL", "HAS_WINDOW", "GROUP"],
    device_arg="q_ptr",
    fit=_fits,
    do_not_specialize=["n_q_bucket", "n_kv_bucket"],
)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    scale: float,
    tf32: bool,
) -> None:
    """Fill `out` with attention(q, k, v); inputs were checked by the wrapper."""
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    precision = "tf32" if tf32 and q.dtype == torch.float32 else "ieee"

    def grid(meta: dict[str, Any]) -> tuple[int, ...]:
        return (triton.cdiv(n_q, meta["BLOCK_M"]), batch * heads)

    ATTENTION_FWD[grid](
        q,
        k,
        v,
        out,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        heads,
        n_q,
        n_kv,
        window or 0,
        scale * LOG2_E,
        bucket(n_q, low=1),
        bucket(n_kv),
        heads // k.shape[1],
        head_dim,
        causal,
        window is not None,
        precision,
    )
