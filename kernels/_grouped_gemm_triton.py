"""The grouped GEMM kernel: a fixed set of programs walks the output tiles of every group, in one launch.

The groups' pointers, shapes and strides sit in one int64 table on the device. The tiles of all groups
are numbered one after another (group by group, row-major inside a group); program p computes
tiles p, p + P, p + 2P, ... for P programs, so small groups share programs instead of each paying
for a launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_build import ConfigLists, TunedKernel, bucket

# One row of the group table, in this order: the addresses of a, b and c; m, n and k; and the strides
# (in elements) am, ak, bk, bn and cm (c is written row-major, so its column stride is 1).
TABLE_FIELDS = 11

ELEMENT_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# Programs launched on CPU: more than one, so the interpreter also walks several tiles per program.
INTERPRETER_PROGRAMS = 4


def _grouped_gemm(
    table_ptr,
    group_count,
    size_bucket,  # autotune key only
    group_bucket,  # autotune key only
    FIELDS: tl.constexpr,
    ELEMENT: tl.constexpr,  # the element type of every a, b and c
    PRECISION: tl.constexpr,
    # 0, or the elements in 16 bytes when every operand is row-major and aligned to 16 bytes
    ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    programs = tl.num_programs(0)
    group_start = 0  # the number of the group's first tile
    for group in range(group_count):
        row = table_ptr + group * FIELDS
        m = tl.load(row + 3).to(tl.int32)
        n = tl.load(row + 4).to(tl.int32)
        k = tl.load(row + 5).to(tl.int32)
        tiles_n = tl.cdiv(n, BLOCK_N)
        group_end = group_start + tl.cdiv(m, BLOCK_M) * tiles_n
        if tile < group_end:
            a_ptr = tl.load(row + 0).to(tl.pointer_type(ELEMENT))
            b_ptr = tl.load(row + 1).to(tl.pointer_type(ELEMENT))
            c_ptr = tl.load(row + 2).to(tl.pointer_type(ELEMENT))
            stride_am = tl.load(row + 6)
            stride_ak = tl.load(row + 7)
            stride_bk = tl.load(row + 8)
            stride_bn = tl.load(row + 9)
            stride_cm = tl.load(row + 10)
            k_len = k
            n_len = n
            if ALIGN > 0:
                # Said to the compiler (the wrapper checked it), this lets the loads vectorize and
                # pipeline through shared memory: unknown strides and sizes would load element by element.
                a_ptr = tl.multiple_of(a_ptr, 16)
                b_ptr = tl.multiple_of(b_ptr, 16)
                c_ptr = tl.multiple_of(c_ptr, 16)
                stride_am = tl.multiple_of(stride_am, ALIGN)
                stride_bk = tl.multiple_of(stride_bk, ALIGN)
                stride_cm = tl.multiple_of(stride_cm, ALIGN)
                stride_ak = 1
                stride_bn = 1
                k_len = tl.multiple_of(k, ALIGN)
                n_len = tl.multiple_of(n, ALIGN)
            while tile < group_end:
                local = tile - group_start
                rows = (local // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
                cols = (local % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for start in range(0, k_len, BLOCK_K):
                    inner = start + tl.arange(0, BLOCK_K)
                    a = tl.load(
                        a_ptr + rows[:, None] * stride_am + inner[None, :] * stride_ak,
                        mask=(rows[:, None] < m) & (inner[None, :] < k_len),
                        other=0.0,
                    )
                    b = tl.load(
                        b_ptr + inner[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=(inner[:, None] < k_len) & (cols[None, :] < n_len),
                        other=0.0,
                    )
                    acc = tl.dot(a, b, acc, input_precision=PRECISION)
                tl.store(
                    c_ptr + rows[:, None] * stride_cm + cols[None, :],
                    acc.to(ELEMENT),
                    mask=(rows[:, None] < m) & (cols[None, :] < n_len),
                )
                tile += programs
        group_start = group_end


def _config(block_m: int, block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages
    )


CONFIGS = ConfigLists(
    hopper=[
        _config(128, 128, 64, 8, 3),
        _config(128, 128, 32, 4, 4),
        _config(128, 64, 64, 4, 3),
        _config(64, 128, 64, 4, 3),
        _config(64, 64, 64, 4, 3),
        _config(32, 64, 64, 4, 3),  # groups of a few rows
    ],
    ampere=[
        _config(128, 128, 32, 8, 3),
        _config(128, 64, 32, 4, 4),
        _config(64, 128, 32, 4, 4),
        _config(64, 64, 32, 4, 4),
        _config(32, 64, 32, 4, 3),  # groups of a few rows
    ],
    interpreter=_config(32, 32, 32, 4, 1),
)

GROUPED_GEMM = TunedKernel(
    _grouped_gemm,
    configs=CONFIGS,
    key=["size_bucket", "group_bucket", "ELEMENT", "ALIGN"],
    device_arg="table_ptr",
    do_not_specialize=["group_count", "size_bucket", "group_bucket"],
)


def launch(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], c: Sequence[torch.Tensor], *, tf32: bool
) -> None:
    """Fill each c[i] (contiguous) with a[i] @ b[i]; inputs were checked by the wrapper."""
    device = a[0].device
    table = torch.tensor(
        [
            [
                x.data_ptr(),
                y.data_ptr(),
                z.data_ptr(),
                x.shape[0],
                y.shape[1],
                x.shape[1],
                x.stride(0),
                x.stride(1),
                y.stride(0),
                y.stride(1),
                z.stride(0),
            ]
            for x, y, z in zip(a, b, c, strict=True)
        ],
        dtype=torch.int64,
    ).to(device)
    shapes = [(x.shape[0], y.shape[1]) for x, y in zip(a, b, strict=True)]
    if device.type == "cuda":
        programs = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        programs = INTERPRETER_PROGRAMS

    def grid(meta: dict[str, Any]) -> tuple[int, ...]:
        tiles = sum(triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]) for m, n in shapes)
        return (max(1, min(tiles, programs)),)

    dtype = a[0].dtype
    GROUPED_GEMM[grid](
        table,
        len(a),
        bucket(max(max(x.shape) for x in (*a, *b))),
        bucket(len(a), low=1),
        TABLE_FIELDS,
        ELEMENT_TYPES[dtype],
        "tf32" if tf32 and dtype == torch.float32 else "ieee",
        alignment(a, b, c),
    )


def alignment(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], c: Sequence[torch.Tensor]) -> int:
    """The kernel's ALIGN: the elements in 16 bytes if every a and b is row-major, every matrix starts on a
    16-byte boundary and every row stride, k and n are multiples of that; else 0 (the general path)."""
    vector = 16 // a[0].element_size()

    def aligned(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> bool:
        return (
            x.stride(1) == 1
            and y.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 and t.stride(0) % vector == 0 for t in (x, y, z))
            and x.shape[1] % vector == 0
            and y.shape[1] % vector == 0
        )

    return vector if all(aligned(x, y, z) for x, y, z in zip(a, b, c, strict=True)) else 0
