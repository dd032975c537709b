"""Kernel benchmark on a CUDA GPU: TFLOP/s of ipnext.kernels against PyTorch baselines
measured in the same run.

    .venv/bin/python bench/kernels.py            # the whole grid (several minutes: autotuning per shape)
    .venv/bin/python bench/kernels.py --quick    # a short subset

1. attention vs torch.nn.functional.scaled_dot_product_attention forced to its FlashAttention backend:
   batch 4, 32 heads, head_dim 64 and 128, sequence 1k to 16k, causal and not, float16 and bfloat16.
   FLOPs = 4 * batch * heads * n_q * n_kv * head_dim (q kᵀ and p v, 2 * n_q * n_kv * head_dim each),
   halved for causal attention with n_q == n_kv.
2. paged_attention (one decode step) vs gathering each sequence's blocks into a dense padded cache and
   calling SDPA on it (its default backend; a padding mask hides the tail): 32 sequences, 32 query heads
   over 8 key/value heads, head_dim 128, cache blocks of 16 tokens, context lengths drawn in [L/2, L].
   FLOPs = 4 * heads * head_dim * sum(context_lens); the kernel is bound by reading the cache, so
   GB/s = 2 * kv_heads * head_dim * bytes per element * sum(context_lens) / time is printed too.
3. grouped_gemm vs a Python loop of torch.matmul and vs one torch.bmm over operands zero-padded to the
   largest m, k and n (padded beforehand, untimed): 4 to 64 GEMMs, m drawn in [128, max size] and k, n
   among the multiples of 16 in that range (model widths), max size 256 or 1024.
   FLOPs = sum over groups of 2 * m * k * n (useful work only: the padding the bmm does is not counted).

Times are medians of triton.testing.do_bench after a first call that compiles and autotunes. Each line
gives both figures and their ratio: baseline time / ipnext time, which is ipnext's TFLOP/s over the
baseline's (above 1: ipnext is faster). Without a GPU it says so and exits 0. Writes
bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ipnext.kernels import attention, grouped_gemm, paged_attention

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEVICE = "cuda"
ATTENTION_BATCH, ATTENTION_HEADS = 4, 32
# Paged decode: sequences, query heads, key/value heads, head_dim, tokens per cache block.
PAGED_SHAPE = (32, 32, 8, 128, 16)


def median_ms(fn: Callable[[], Any]) -> float:
    import triton.testing  # only on the GPU path

    fn()  # compile and autotune outside the timing
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def triton_version() -> str:
    import triton

    return str(triton.__version__)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def report(
    kind: str, shape: str, flops: float, ours_ms: float, baselines: dict[str, float]
) -> dict[str, Any]:
    ours = tflops(flops, ours_ms)
    parts = [f"ipnext {ours:7.1f} TFLOP/s ({ours_ms:.3f} ms)"]
    row: dict[str, Any] = {"kind": kind, "shape": shape, "flops": flops, "ipnext_ms": ours_ms}
    row["ipnext_tflops"] = round(ours, 2)
    for name, ms in baselines.items():
        theirs = tflops(flops, ms)
        parts.append(f"{name} {theirs:7.1f} TFLOP/s ({ms:.3f} ms), ratio {ms / ours_ms:.2f}")
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = round(theirs, 2)
        row[f"ratio_vs_{name}"] = round(ms / ours_ms, 3)
    print(f"{kind:9} {shape:46} " + " | ".join(parts), flush=True)
    return row


def attention_case(dtype_name: str, head_dim: int, n: int, causal: bool) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads = ATTENTION_BATCH, ATTENTION_HEADS
    q, k, v = (
        torch.randn(batch, heads, n, head_dim, device=DEVICE, dtype=DTYPES[dtype_name]) for _ in range(3)
    )

    def ours() -> torch.Tensor:
        return attention(q, k, v, causal=causal)

    def sdpa_flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    error = (ours() - sdpa_flash()).abs().max().item()
    flops = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    shape = f"{dtype_name} b={batch} h={heads} d={head_dim} n={n} {'causal' if causal else 'full'}"
    row = report("attention", shape, flops, median_ms(ours), {"sdpa_flash": median_ms(sdpa_flash)})
    row["max_abs_diff_vs_sdpa"] = error
    return row


def paged_case(dtype_name: str, longest: int, generator: torch.Generator) -> dict[str, Any]:
    num_seqs, heads, kv_heads, head_dim, block_size = PAGED_SHAPE
    dtype = DTYPES[dtype_name]
    lens = torch.randint(longest // 2, longest + 1, (num_seqs,), generator=generator)
    max_blocks = -(-longest // block_size)
    num_blocks = num_seqs * max_blocks
    table = torch.randperm(num_blocks, generator=generator).reshape(num_seqs, max_blocks)
    table, lens = table.to(DEVICE, torch.int32), lens.to(DEVICE, torch.int32)
    q = torch.randn(num_seqs, heads, head_dim, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    visible = torch.arange(max_blocks * block_size, device=DEVICE)[None, :] < lens[:, None]

    def ours() -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, table, lens)

    def gather_sdpa() -> torch.Tensor:
        # (seqs, blocks, kv_heads, block_size, d) -> (seqs, kv_heads, tokens, d)
        keys = k_cache[table].transpose(1, 2).reshape(num_seqs, kv_heads, -1, head_dim)
        values = v_cache[table].transpose(1, 2).reshape(num_seqs, kv_heads, -1, head_dim)
        mask = visible[:, None, None, :]
        return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)[
            :, :, 0
        ]

    error = (ours() - gather_sdpa()).abs().max().item()
    tokens = int(lens.sum())
    flops = 4 * heads * head_dim * tokens
    shape = f"{dtype_name} seqs={num_seqs} h={heads}/{kv_heads} d={head_dim} ctx<={longest}"
    ours_ms = median_ms(ours)
    row = report("paged", shape, flops, ours_ms, {"gather_sdpa": median_ms(gather_sdpa)})
    cache_bytes = 2 * kv_heads * head_dim * k_cache.element_size() * tokens
    row["ipnext_cache_gb_per_s"] = round(cache_bytes / (ours_ms * 1e-3) / 1e9, 1)
    row["max_abs_diff_vs_gather_sdpa"] = error
    print(f"{'':9} {'':46} ipnext reads the cache at {row['ipnext_cache_gb_per_s']} GB/s", flush=True)
    return row


def grouped_case(dtype_name: str, groups: int, max_size: int, generator: torch.Generator) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    # m (tokens routed to an expert, rows of a feature) is anything;
    # k and n (model widths) are multiples of 16.
    m = torch.randint(128, max_size + 1, (groups,), generator=generator)
    k, n = (torch.randint(8, max_size // 16 + 1, (groups,), generator=generator) * 16 for _ in range(2))
    shapes = torch.stack([m, k, n], dim=1).tolist()
    a = [torch.randn(m, k, device=DEVICE, dtype=dtype) for m, k, _ in shapes]
    b = [torch.randn(k, n, device=DEVICE, dtype=dtype) for _, k, n in shapes]
    big_m, big_k, big_n = (max(s[i] for s in shapes) for i in range(3))
    a_padded = torch.zeros(groups, big_m, big_k, device=DEVICE, dtype=dtype)
    b_padded = torch.zeros(groups, big_k, big_n, device=DEVICE, dtype=dtype)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        a_padded[i, : x.shape[0], : x.shape[1]] = x
        b_padded[i, : y.shape[0], : y.shape[1]] = y

    def ours() -> list[torch.Tensor]:
        return grouped_gemm(a, b)

    def matmul_loop() -> list[torch.Tensor]:
        return [torch.matmul(x, y) for x, y in zip(a, b, strict=True)]

    def padded_bmm() -> torch.Tensor:
        return torch.bmm(a_padded, b_padded)

    error = max((x - y).abs().max().item() for x, y in zip(ours(), matmul_loop(), strict=True))
    flops = sum(2 * m * k * n for m, k, n in shapes)
    shape = f"{dtype_name} groups={groups} m,k,n in 128..{max_size}"
    baselines = {"matmul_loop": median_ms(matmul_loop), "padded_bmm": median_ms(padded_bmm)}
    row = report("grouped", shape, flops, median_ms(ours), baselines)
    row["max_abs_diff_vs_matmul_loop"] = error
    return row


def bench_attention(quick: bool) -> list[dict[str, Any]]:
    return [
        attention_case(dtype_name, head_dim, n, causal)
        for dtype_name in (["fp16"] if quick else ["fp16", "bf16"])
        for head_dim in ([128] if quick else [64, 128])
        for n in ([1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384])
        for causal in (False, True)
    ]


def bench_paged_attention(quick: bool) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return [
        paged_case(dtype_name, longest, generator)
        for dtype_name in (["fp16"] if quick else ["fp16", "bf16"])
        for longest in ([4096] if quick else [1024, 4096, 16384])
    ]


def bench_grouped_gemm(quick: bool) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return [
        grouped_case(dtype_name, groups, max_size, generator)
        for dtype_name in (["fp16"] if quick else ["fp16", "bf16"])
        for groups in ([16] if quick else [4, 16, 64])
        for max_size in ([1024] if quick else [256, 1024])
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short subset of every table")
    parser.add_argument("--only", nargs="*", choices=["attention", "paged", "grouped"], default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kernels.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (none is visible): nothing measured.")
        sys.exit(0)
    torch.manual_seed(0)
    print(
        "FLOPs: attention 4*b*h*n_q*n_kv*d (halved for causal, n_q == n_kv); "
        "paged 4*h*d*sum(context_lens); grouped sum(2*m*k*n). Ratio = baseline time / ipnext time."
    )
    tables = {"attention": bench_attention, "paged": bench_paged_attention, "grouped": bench_grouped_gemm}
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "quick": args.quick,
    }
    for name, run in tables.items():
        if args.only is None or name in args.only:
            results[name] = run(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
