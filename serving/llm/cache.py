"""The paged KV cache: a pool of fixed-size blocks shared by every sequence, with reference
counts, and a prefix cache that lets a full block of prompt tokens be reused by content.

A block's content is identified by a chained hash: the hash of its tokens together with the
hash of the block before it, so equal hashes mean equal whole prefixes, not just equal blocks.
A full block is registered under that hash once its keys and values are written; a later
sequence whose prompt starts with the same tokens takes the block (its count goes up) instead
of computing it again. Freed blocks keep their content and hash and sit in LRU order, so a
popular system prompt survives until its blocks are the oldest free ones and are needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["BlockPool", "KVCache", "block_hashes"]


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of every full block of `tokens`."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(previous)
        digest.update(b",".join(str(t).encode() for t in tokens[start : start + block_size]))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class BlockPool:
    """Block ids 0 .. num_blocks - 1, each used by zero or more sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: need at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        # Blocks no sequence uses, oldest first: allocation takes the front, frees go to the back.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.hits = 0  # blocks reused from the prefix cache
        self.lookups = 0

    def free_count(self) -> int:
        return len(self._free)

    def used_count(self) -> int:
        return self.num_blocks - len(self._free)

    def cached_count(self) -> int:
        return len(self._by_hash)

    def allocate(self) -> int | None:
        """A block for new content (count 1), evicting the least recently freed cached block;
        None when every block is in use."""
        if not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None and self._by_hash.get(old) == block:
            del self._by_hash[old]
        self._refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise RuntimeError(f"block {block} released more often than taken")
        if self._refs[block] == 0:
            self._free[block] = None  # most recently freed: evicted last

    def take_cached(self, block_hash: bytes) -> int | None:
        """The block holding this prefix block, its count raised; None if not cached."""
        self.lookups += 1
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1
        self.hits += 1
        return block

    def holds(self, block_hash: bytes) -> bool:
        """Whether a block holds this prefix block (nothing taken, nothing counted)."""
        return block_hash in self._by_hash

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` now holds the full prefix block `block_hash` (first writer wins)."""
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def refs(self, block: int) -> int:
        return self._refs[block]


class KVCache:
    """Per layer, keys and values as (num_blocks, n_kv_heads, block_size, head_dim) tensors, the
    layout `ipnext.kernels.paged_attention` reads; sized in bytes."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        cache_bytes: int,
        dtype: torch.dtype,
    ) -> None:
        element = torch.tensor([], dtype=dtype).element_size()
        per_block = 2 * n_layers * n_kv_heads * block_size * head_dim * element
        num_blocks = cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes: {cache_bytes} bytes hold no block of {per_block} bytes "
                f"({block_size} tokens); give at least {per_block}"
            )
        shape = (num_blocks, n_kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.bytes = num_blocks * per_block

    def write(
        self,
        layer: int,
        slots_block: torch.Tensor,
        slots_offset: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store keys and values (tokens, n_kv_heads, head_dim) at their (block, offset) slots."""
        self.keys[layer][slots_block, :, slots_offset] = k
        self.values[layer][slots_block, :, slots_offset] = v

    def gather(self, layer: int, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` keys and values as (n_kv_heads, length, head_dim)."""
        index = torch.tensor(blocks, dtype=torch.long)
        k = self.keys[layer][index].permute(1, 0, 2, 3).flatten(1, 2)[:, :length]
        v = self.values[layer][index].permute(1, 0, 2, 3).flatten(1, 2)[:, :length]
        return k, v
