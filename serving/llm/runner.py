"""One forward step of the decoder family over a mixed batch: prefill chunks and decode tokens of
many sequences at once, keys and values kept in the paged cache.

Every linear layer runs once over all the step's tokens together (that is where batching pays);
attention is per kind: all one-token (decode) rows in one `ipnext.kernels.paged_attention`
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
        self._w = {name: weights[name].to(dtype) for name in expected_tensors(config)}

    @torch.no_grad()
    def step(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks; return the logits (one row per chunk with `sample`, in order)."""
        c, w, cache = self.config, self._w, self.cache
        bs = cache.block_size
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

        x = w["tok_embeddings.weight"][tokens]
        for layer in range(c.n_layers):
            n = layer_names(layer)
            h = rms_norm(x, w[n["attention_norm"]], c.norm_eps)
            q, k, v = h @ w[n["wq"]].T, h @ w[n["wk"]].T, h @ w[n["wv"]].T
            if c.qkv_bias:
                q, k, v = q + w[n["bq"]], k + w[n["bk"]], v + w[n["bv"]]
            q = q.view(-1, c.n_heads, c.head_dim)
            k = k.view(-1, c.n_kv_heads, c.head_dim)
            v = v.view(-1, c.n_kv_heads, c.head_dim)
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
            x = x + out.flatten(1) @ w[n["wo"]].T
            h = rms_norm(x, w[n["ffn_norm"]], c.norm_eps)
            gate = torch.nn.functional.silu(h @ w[n["w1"]].T)
            x = x + (gate * (h @ w[n["w3"]].T)) @ w[n["w2"]].T
        last = torch.tensor([spans[i][1] - 1 for i, ch in enumerate(chunks) if ch.sample], dtype=torch.long)
        final = rms_norm(x[last], w["norm.weight"], c.norm_eps)
        return final @ output_weight(c, w).T
