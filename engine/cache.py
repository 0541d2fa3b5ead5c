"""Paged KV caches and the block allocator that owns their blocks.

- MLA (`LatentKVCache`): per layer [num_blocks, block_size, R + P]: for every token the normalized
  latent c (which is both K and V after absorption) followed by the roped shared key k_pe.
- GQA (`HeadKVCache`): per layer K [num_blocks, block_size, Hkv, Dk] and V [.., Hkv, Dv], the
  layout the paged_decode / paged_extend kernels read.
A sequence owns an ordered list of blocks (its block table); slot = block_id · block_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import MoetuneError


class BlockAllocator:
    """Free list of block ids; blocks are handed out lowest-first and returned on free."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MoetuneError(f"KV cache full: {n} blocks wanted, {len(self._free)} free "
                               "(raise max_total_tokens)")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class SeqCache:
    """One sequence's view of the cache: its blocks and how many tokens they hold."""

    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedCache:
    """Blocks and their allocation, whatever a block holds (the subclasses' tensors)."""

    def __init__(self, num_tokens: int, block_size: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(-(-num_tokens // block_size))

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def blocks_needed(self, seq: SeqCache, new_tokens: int) -> int:
        total = seq.num_tokens + new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def reserve(self, seq: SeqCache, new_tokens: int) -> None:
        """Room for `new_tokens` more tokens (blocks allocated, num_tokens advanced), no slots:
        the engine computes a whole step's slots at once from its block tables."""
        seq.block_table += self.allocator.allocate(self.blocks_needed(seq, new_tokens))
        seq.num_tokens += new_tokens

    def append(self, seq: SeqCache, new_tokens: int) -> torch.Tensor:
        """Reserve room for `new_tokens` more tokens; returns their slots [new_tokens] int64."""
        start = seq.num_tokens
        self.reserve(seq, new_tokens)
        pos = torch.arange(start, start + new_tokens)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def release(self, seq: SeqCache) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table, seq.num_tokens = [], 0

    @staticmethod
    def block_tables(seqs: list[SeqCache]) -> torch.Tensor:
        """[B, max blocks] int32, padded with 0 (never read past seq_lens)."""
        width = max(len(s.block_table) for s in seqs)
        return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                            dtype=torch.int32)


class LatentKVCache(PagedCache):
    def __init__(self, num_layers: int, num_tokens: int, block_size: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(num_tokens, block_size)
        self.layers = torch.zeros(num_layers, self.allocator.num_blocks, block_size, width, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [T, R + P] at slots [T]."""
        self.layers[layer].view(-1, self.layers.shape[-1])[slots.to(self.layers.device)] = rows.to(self.layers.dtype)

    def rows(self, layer: int, seq: SeqCache) -> torch.Tensor:
        """The sequence's cached rows [num_tokens, R + P], in token order."""
        blocks = self.layers[layer][torch.tensor(seq.block_table, dtype=torch.int64)]
        return blocks.reshape(-1, blocks.shape[-1])[: seq.num_tokens]


class HeadKVCache(PagedCache):
    """K and V per KV head: k[layer] [NB, BS, Hkv, Dk], v[layer] [NB, BS, Hkv, Dv]."""

    def __init__(self, num_layers: int, num_tokens: int, block_size: int, kv_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__(num_tokens, block_size)
        nb = self.allocator.num_blocks
        self.k = torch.zeros(num_layers, nb, block_size, kv_heads, k_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, nb, block_size, kv_heads, v_dim, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k [T, Hkv, Dk] and v [T, Hkv, Dv] at slots [T]."""
        slots = slots.to(self.k.device)
        self.k[layer].flatten(0, 1)[slots] = k.to(self.k.dtype)
        self.v[layer].flatten(0, 1)[slots] = v.to(self.v.dtype)
