"""One forward step of the decoder family over a mixed batch: prefill chunks and decode tokens of
many sequences at once, keys and values kept in the paged cache.

Every linear layer runs once over all the step's tokens together (that is where batching pays),
its weights laid out for that at load: each stored transposed and contiguous, (in, out), and the
layers that read the same input fused into one matrix (q, k and v; the gate and up projections).
On one CPU thread a 16-row step's matmuls took 30% less time so than against the checkpoint's
(out, in) tensors one by one. Where torch has oneDNN, each matrix is also prepacked for it at load
(`_Linear`): on an AMD EPYC, where torch's default GEMM (MKL) runs a slow path, a 16-row
product took 2.5x less time so, and a 16-sequence decode step of bench/llm.py's model 9.8 ms
instead of 16.3 (one thread).
Attention is per kind: all one-token (decode) rows in one `ipnext.kernels.paged_attention`
call over the block tables, each prefill chunk through `ipnext.kernels.attention` over its
cached prefix plus the chunk (causal, aligned to the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipnext.kernels import attention, paged_attention
from ipnext.serving.llm.cache import KVCache
from ipnext.serving.llm.model import (
    DecoderConfig,
    apply_rotary,
    expected_tensors,
    layer_names,
    output_weight,
    rms_norm,
    rotary_tables,
)

__all__ = ["Chunk", "ModelRunner"]


@dataclass(frozen=True)
class Chunk:
    """`count` tokens of a sequence from position `start`, whose keys go to `blocks`."""

    tokens: list[int]  # the chunk's tokens
    start: int
    blocks: list[int]
    sample: bool  # the chunk ends at the sequence's newest token: its logits pick the next one


@dataclass(frozen=True)
class _Layer:
    """One layer's weights as the step multiplies them: (in, out), contiguous, fused."""

    attention_norm: torch.Tensor
    qkv: torch.Tensor  # (dim, (heads + 2 * kv_heads) * head_dim): q, k, v side by side
    qkv_bias: torch.Tensor | None
    wo: torch.Tensor  # (heads * head_dim, dim)
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor  # (dim, 2 * hidden): the gate's columns, then the up projection's
    down: torch.Tensor  # (hidden, dim)


def _stacked(weights: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """The named (out, in) matrices as one (in, sum of outs) contiguous matrix of `dtype`."""
    return torch.cat([weights[name].to(dtype) for name in names]).T.contiguous()


# The batch size oneDNN packs for (a hint: any row count multiplies correctly): a decode step's.
PACK_ROWS = 16


class _Linear:
    """`x @ w` for the runner's (in, out) weights, by oneDNN's prepacked float32 product where
    torch has it, else by `torch.mm`. The packed form is decided once, at load, by a probe: a
    torch without the op, or one whose answer differs from `mm`, keeps plain matrices (the
    ops are the ones torch's own compiler uses for frozen CPU models, not a public API)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.packed = dtype == torch.float32 and _onednn_agrees()

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """`w` (in, out) as this product multiplies it: prepacked (out, in), or as it is."""
        if not self.packed:
            return w
        return torch.ops.mkldnn._reorder_linear_weight(w.T.contiguous(), PACK_ROWS)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return x @ w
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _onednn_agrees() -> bool:
    """Whether oneDNN's prepacked product runs here and matches `mm` on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    probe = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=probe), torch.randn(64, 48, generator=probe)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.T.contiguous(), PACK_ROWS)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, TypeError):
        return False
    return bool(torch.allclose(got, x @ w, rtol=1e-5, atol=1e-5))


class ModelRunner:
    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        config: DecoderConfig,
        cache: KVCache,
        dtype: torch.dtype = torch.float32,
        backend: str | None = None,
    ) -> None:
        missing = sorted(set(expected_tensors(config)) - set(weights))
        if missing:
            raise ValueError(
                f"weights: missing {missing[:3]}{' ...' if len(missing) > 3 else ''} for {config}"
            )
        self.config = config
        self.cache = cache
        self.dtype = dtype
        self.backend = backend
        self._embeddings = weights["tok_embeddings.weight"].to(dtype)
        self._norm = weights["norm.weight"].to(dtype)
        self._mm = mm = _Linear(dtype)
        self._output = mm.pack(output_weight(config, weights).to(dtype).T.contiguous())  # (dim, vocab)
        self._layers = []
        for layer in range(config.n_layers):
            n = layer_names(layer)
            bias = [n["bq"], n["bk"], n["bv"]] if config.qkv_bias else None
            self._layers.append(
                _Layer(
                    attention_norm=weights[n["attention_norm"]].to(dtype),
                    qkv=mm.pack(_stacked(weights, [n["wq"], n["wk"], n["wv"]], dtype)),
                    qkv_bias=torch.cat([weights[b].to(dtype) for b in bias]) if bias else None,
                    wo=mm.pack(_stacked(weights, [n["wo"]], dtype)),
                    ffn_norm=weights[n["ffn_norm"]].to(dtype),
                    gate_up=mm.pack(_stacked(weights, [n["w1"], n["w3"]], dtype)),
                    down=mm.pack(_stacked(weights, [n["w2"]], dtype)),
                )
            )

    @torch.no_grad()
    def step(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks; return the logits (one row per chunk with `sample`, in order)."""
        c, cache, mm = self.config, self.cache, self._mm
        bs = cache.block_size
        q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        tokens = torch.tensor([t for ch in chunks for t in ch.tokens], dtype=torch.long)
        positions = torch.cat([torch.arange(ch.start, ch.start + len(ch.tokens)) for ch in chunks])
        slot_block = torch.tensor(
            [ch.blocks[p // bs] for ch in chunks for p in range(ch.start, ch.start + len(ch.tokens))],
            dtype=torch.long,
        )
        slot_offset = positions % bs
        cos, sin = rotary_tables(c, positions, self.dtype)
        spans = []
        row = 0
        for ch in chunks:
            spans.append((row, row + len(ch.tokens)))
            row += len(ch.tokens)
        decode = [i for i, ch in enumerate(chunks) if len(ch.tokens) == 1]
        prefill = [i for i, ch in enumerate(chunks) if len(ch.tokens) > 1]
        if decode:
            decode_rows = torch.tensor([spans[i][0] for i in decode])
            width = max(len(chunks[i].blocks) for i in decode)
            table = torch.zeros((len(decode), width), dtype=torch.int32)
            for j, i in enumerate(decode):
                table[j, : len(chunks[i].blocks)] = torch.tensor(chunks[i].blocks, dtype=torch.int32)
            context = torch.tensor([chunks[i].start + 1 for i in decode], dtype=torch.int32)

        x = self._embeddings[tokens]
        for layer, w in enumerate(self._layers):
            h = rms_norm(x, w.attention_norm, c.norm_eps)
            qkv = mm(h, w.qkv)
            if w.qkv_bias is not None:
                qkv = qkv + w.qkv_bias
            q = qkv[:, :q_width].view(-1, c.n_heads, c.head_dim)
            k = qkv[:, q_width : q_width + kv_width].view(-1, c.n_kv_heads, c.head_dim)
            v = qkv[:, q_width + kv_width :].view(-1, c.n_kv_heads, c.head_dim)
            window = c.window(layer)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.write(layer, slot_block, slot_offset, k, v)
            out = torch.empty_like(q)
            if decode:
                out[decode_rows] = paged_attention(
                    q[decode_rows],
                    cache.keys[layer],
                    cache.values[layer],
                    table,
                    context,
                    window=window,
                    backend=self.backend,
                )
            for i in prefill:
                ch, (lo, hi) = chunks[i], spans[i]
                keys, values = cache.gather(layer, ch.blocks, ch.start + len(ch.tokens))
                out[lo:hi] = attention(
                    q[lo:hi].transpose(0, 1)[None],
                    keys[None],
                    values[None],
                    causal=True,
                    window=window,
                    backend=self.backend,
                )[0].transpose(0, 1)
            x = x + mm(out.flatten(1), w.wo)
            h = rms_norm(x, w.ffn_norm, c.norm_eps)
            gate, up = mm(h, w.gate_up).chunk(2, dim=-1)
            x = x + mm(torch.nn.functional.silu(gate) * up, w.down)
        last = torch.tensor([spans[i][1] - 1 for i, ch in enumerate(chunks) if ch.sample], dtype=torch.long)
        final = rms_norm(x[last], self._norm, c.norm_eps)
        return mm(final, self._output)
