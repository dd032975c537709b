"""Decode attention over a paged key/value cache: the checked wrapper, its torch reference and its C path.

Each sequence's keys and values live in fixed-size blocks of one shared cache; its row of the block
table lists them in order, and its context length says how many of their tokens count. On CPU,
float32 calls run the C kernel of `_paged_attention_cpu.c` (compiled for the host on first use,
see `_cpu_build`), which reads the blocks in place; the torch reference serves where it cannot.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

from . import _cpu_build
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

Q_LAYOUT = "(num_seqs, heads, head_dim)"
CACHE_LAYOUT = "(num_blocks, kv_heads, block_size, head_dim)"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One decode step of attention for a batch of sequences of different lengths,
    keys read from a paged cache.

    q is (num_seqs, heads, head_dim), one query token per sequence; k_cache and v_cache are
    (num_blocks, kv_heads, block_size, head_dim), heads a multiple of kv_heads; block_table is
    (num_seqs, max_blocks) int32, sequence s's token t living in cache block block_table[s, t // block_size]
    at slot t % block_size; context_lens is (num_seqs,) int32, each in [0, max_blocks * block_size].
    The query sees all of its sequence's context_len tokens (no causal mask: it is the newest token),
    or with `window` only the last `window` of them (a sliding window, the query's own included).
    A sequence with context_len 0 attends to nothing and gets zeros. Block table entries past a
    sequence's context are never read; those it uses must lie in [0, num_blocks) (checked, which
    syncs with the device). head_dim is 16, 32, 64 or 128; dtype float16, bfloat16 or float32;
    `scale` defaults to 1/sqrt(head_dim). Returns (num_seqs, heads, head_dim) in q's dtype.

    backend: as for `attention`, except that None on CPU runs the compiled C kernel for float32
    inputs where it builds (the torch reference otherwise); backend="torch" always runs the reference.
    """
    q, k_cache, v_cache, block_table, context_lens, longest = _check(
        q, k_cache, v_cache, block_table, context_lens
    )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise bad_input("window", "None or an integer >= 1", repr(window))
    scale = default_scale(scale, q.shape[2])
    if choose_backend(backend, q.device) == "torch":
        if backend is None and cpu_kernel_fits(q, k_cache):
            kernel = _cpu_kernel()
            if kernel is not None:
                return _run_cpu(kernel, q, k_cache, v_cache, block_table, context_lens, window, scale)
        return paged_attention_reference(
            q, k_cache, v_cache, block_table, context_lens, window=window, scale=scale
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    _launch(
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        out,
        longest_context=longest,
        window=window,
        scale=scale,
    )
    return out


def _launch(
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
) -> None:
    from ._paged_attention_triton import launch  # triton is imported only on the Triton path

    launch(
        q,
        k_cache,
        v_cache,
        block_table.contiguous(),
        context_lens.contiguous(),
        out,
        longest_context=longest_context,
        window=window,
        scale=scale,
        tf32=tf32_allowed(),
    )


CPU_MAX_GROUP = 64  # the C kernel's limits (MAX_GROUP, MAX_BLOCK in the source)
CPU_MAX_BLOCK = 256
_cpu_lock = threading.Lock()
_cpu_function: list[Callable[..., None] | None] = []


def cpu_kernel_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these (checked) inputs: float32 CPU tensors within its limits."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and q.shape[1] // k_cache.shape[1] <= CPU_MAX_GROUP
        and k_cache.shape[2] <= CPU_MAX_BLOCK
    )


def _cpu_kernel() -> Callable[..., None] | None:
    """The C kernel's entry point, built on first use; None where it cannot be built (logged once)."""
    with _cpu_lock:
        if not _cpu_function:
            library = _cpu_build.load("_paged_attention_cpu.c")
            function = None
            if library is not None:
                function = library.ipnext_paged_attention_f32
                pointer, size = ctypes.c_void_p, ctypes.c_int64
                function.argtypes = [pointer] * 6 + [size] * 7 + [ctypes.c_float, size]
                function.restype = None
            _cpu_function.append(function)
        return _cpu_function[0] if _cpu_build.enabled() else None


def _run_cpu(
    kernel: Callable[..., None],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """The C kernel on checked float32 CPU inputs, on as many threads as torch uses."""
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_table, context_lens = block_table.contiguous(), context_lens.contiguous()
    num_seqs, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    # ctypes lets go of the GIL for the call, so other Python threads run meanwhile.
    kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        heads,
        k_cache.shape[1],
        head_dim,
        k_cache.shape[2],
        block_table.shape[1],
        window or 0,
        scale,
        torch.get_num_threads(),
    )
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same in torch, block by block: the CPU serving path.

    Only the blocks a sequence's context (or window) uses are read, each once, with no padding to
    the longest sequence: every used block is gathered into one flat batch, scored against its
    sequence's query, and each sequence's softmax is taken over its own blocks (a segment max and
    sum by `index_add_`). Copying whole padded contexts cost 2.8 ms a layer on a 16-sequence step
    of 512-token contexts on one CPU thread; this is about 1.3 ms.

    Takes inputs as `paged_attention` accepts them (not checked here), in any floating dtype.
    """
    num_seqs, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    lengths = context_lens.long()
    end = (lengths + block_size - 1) // block_size  # one past each sequence's last block
    first = torch.zeros_like(end) if window is None else (lengths - window).clamp(min=0) // block_size
    counts = end - first
    used = int(counts.sum())
    if used == 0:
        return torch.zeros_like(q)
    # Block i of the flat batch: sequence seq[i], its block number index[i], cache block physical[i].
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    index = torch.arange(used, device=device) - starts[seq] + first[seq]
    physical = block_table[seq, index].long()
    keys = k_cache.index_select(0, physical).to(compute)  # (used, kv_heads, block_size, head_dim)
    values = v_cache.index_select(0, physical).to(compute)
    query = q.to(compute).reshape(num_seqs, kv_heads, group, head_dim).index_select(0, seq)
    scale = head_dim**-0.5 if scale is None else scale
    scores = (query @ keys.transpose(-1, -2)) * scale  # (used, kv_heads, group, block_size)
    position = index[:, None] * block_size + torch.arange(block_size, device=device)[None, :]
    length = lengths.index_select(0, seq)[:, None]
    visible = position < length
    if window is not None:
        visible &= position >= length - window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # Each block holds at least one visible token, so every sequence's peak is finite.
    peak = torch.full((num_seqs, kv_heads, group), float("-inf"), dtype=compute, device=device)
    peak = peak.scatter_reduce(0, seq[:, None, None].expand(-1, kv_heads, group), scores.amax(-1), "amax")
    weights = torch.exp(scores - peak.index_select(0, seq)[..., None])  # hidden tokens: exp(-inf) = 0
    shape = (num_seqs, kv_heads, group)
    total = torch.zeros(shape, dtype=compute, device=device).index_add_(0, seq, weights.sum(-1))
    out = torch.zeros((*shape, head_dim), dtype=compute, device=device).index_add_(0, seq, weights @ values)
    # A sequence with context 0 has no blocks: its total is 0 and its answer zeros.
    out = torch.where(total[..., None] > 0, out / total.clamp(min=1e-30)[..., None], 0.0)
    return out.reshape(num_seqs, heads, head_dim).to(q.dtype)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The checked inputs and the longest context; the data checks (lengths, table entries) sync."""
    q = check_tensor("q", q, ndim=3, layout=Q_LAYOUT, dtypes=FLOAT_DTYPES)
    num_seqs, heads, head_dim = q.shape
    check_head_dim("q", head_dim, Q_LAYOUT)
    expected_cache = f"(num_blocks, kv_heads, block_size, head_dim={head_dim})"
    k_cache = check_tensor("k_cache", k_cache, ndim=4, layout=CACHE_LAYOUT, dtypes=FLOAT_DTYPES)
    check_same_dtype("k_cache", k_cache, "q", q)
    check_same_device("k_cache", k_cache, "q", q)
    num_blocks, kv_heads, block_size = k_cache.shape[:3]
    if k_cache.shape[3] != head_dim or num_blocks < 1 or block_size < 1:
        raise bad_input(
            "k_cache", f"shape {expected_cache} with num_blocks, block_size >= 1", tuple(k_cache.shape)
        )
    check_heads("k_cache", heads, kv_heads, expected_cache)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, layout=CACHE_LAYOUT, dtypes=FLOAT_DTYPES)
    check_same_dtype("v_cache", v_cache, "q", q)
    check_same_device("v_cache", v_cache, "q", q)
    if v_cache.shape != k_cache.shape:
        raise bad_input(
            "v_cache", f"shape {tuple(k_cache.shape)} (the shape of k_cache)", tuple(v_cache.shape)
        )

    table_layout = f"(num_seqs={num_seqs}, max_blocks)"
    block_table = check_tensor("block_table", block_table, ndim=2, layout=table_layout, dtypes=[torch.int32])
    check_same_device("block_table", block_table, "q", q)
    if block_table.shape[0] != num_seqs:
        raise bad_input("block_table", f"shape {table_layout}", tuple(block_table.shape))
    max_blocks = block_table.shape[1]
    lens_layout = f"(num_seqs={num_seqs},)"
    context_lens = check_tensor(
        "context_lens", context_lens, ndim=1, layout=lens_layout, dtypes=[torch.int32]
    )
    check_same_device("context_lens", context_lens, "q", q)
    if context_lens.shape[0] != num_seqs:
        raise bad_input("context_lens", f"shape {lens_layout}", tuple(context_lens.shape))
    if num_seqs == 0:
        return q, k_cache, v_cache, block_table, context_lens, 0

    capacity = max_blocks * block_size
    out_of_range = (context_lens < 0) | (context_lens > capacity)
    blocks_used = (context_lens.long().clamp(0, capacity) + block_size - 1) // block_size
    used = torch.arange(max_blocks, device=q.device)[None, :] < blocks_used[:, None]
    outside = used & ((block_table < 0) | (block_table >= num_blocks))
    # One sync for all three answers.
    any_bad_length, any_bad_entry, longest = torch.stack(
        [out_of_range.any().long(), outside.any().long(), context_lens.max().long()]
    ).tolist()
    if any_bad_length:
        seq = int(out_of_range.nonzero()[0, 0])
        raise bad_input(
            "context_lens",
            f"lengths in [0, max_blocks * block_size = {max_blocks} * {block_size} = {capacity}]",
            f"context_lens[{seq}] = {int(context_lens[seq])}",
        )
    if any_bad_entry:
        seq, index = (int(i) for i in outside.nonzero()[0])
        raise bad_input(
            "block_table",
            f"entries in [0, num_blocks={num_blocks}) for the blocks each sequence's context uses",
            f"block_table[{seq}, {index}] = {int(block_table[seq, index])}",
        )
    return q, k_cache, v_cache, block_table, context_lens, int(longest)
