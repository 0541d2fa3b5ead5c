"""Paged KV caches and the block allocator that owns their blocks.

- MLA (`LatentKVCache`): per layer [num_blocks, block_size, R + P]: for every token the normalized
  latent c (which is both K and V after absorption) followed by the roped shared key k_pe.
- GQA (`HeadKVCache`): per layer K [num_blocks, block_size, Hkv, Dk] and V [.., Hkv, Dv], the
  layout the paged_decode / paged_extend kernels read.
A sequence owns an ordered list of blocks (its block table); slot = block_id · block_size + offset.

Blocks are reference-counted: `fork` gives a new sequence the blocks of another (the samples of
one prompt share its prefill), and a sequence about to write into a block it shares copies that
block first (copy on write). A block returns to the free list when its last holder releases it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import MoetuneError


class BlockAllocator:
    """Free list of block ids with a holder count per block; blocks are handed out lowest-first and
    return to the free list when their last holder frees them."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MoetuneError(f"KV cache full: {n} blocks wanted, {len(self._free)} free "
                               "(raise max_total_tokens)")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)


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

    def _shared_tail(self, seq: SeqCache, new_tokens: int) -> bool:
        """The next tokens would be written into a partly filled last block that another sequence holds."""
        return (new_tokens > 0 and seq.num_tokens % self.block_size != 0
                and self.allocator.refs[seq.block_table[-1]] > 1)

    def blocks_needed(self, seq: SeqCache, new_tokens: int) -> int:
        total = seq.num_tokens + new_tokens
        grow = max(0, -(-total // self.block_size) - len(seq.block_table))
        return grow + self._shared_tail(seq, new_tokens)

    def reserve(self, seq: SeqCache, new_tokens: int) -> None:
        """Room for `new_tokens` more tokens (blocks allocated, num_tokens advanced), no slots:
        the engine computes a whole step's slots at once from its block tables. A shared last
        block that the new tokens would write into is copied first."""
        if self._shared_tail(seq, new_tokens):
            old, (new,) = seq.block_table[-1], self.allocator.allocate(1)
            self._copy_block(old, new)
            self.allocator.free([old])
            seq.block_table[-1] = new
        seq.block_table += self.allocator.allocate(self.blocks_needed(seq, new_tokens))
        seq.num_tokens += new_tokens

    def _copy_block(self, old: int, new: int) -> None:
        """Block `old`'s contents into block `new`, in every layer (the subclasses' tensors)."""
        raise NotImplementedError

    def fork(self, seq: SeqCache) -> SeqCache:
        """A new sequence holding the same tokens in the same blocks (shared, copied on write)."""
        self.allocator.share(seq.block_table)
        return SeqCache(list(seq.block_table), seq.num_tokens)

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

    def _copy_block(self, old: int, new: int) -> None:
        self.layers[:, new] = self.layers[:, old]

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

    def _copy_block(self, old: int, new: int) -> None:
        self.k[:, new] = self.k[:, old]
        self.v[:, new] = self.v[:, old]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k [T, Hkv, Dk] and v [T, Hkv, Dv] at slots [T]."""
        slots = slots.to(self.k.device)
        self.k[layer].flatten(0, 1)[slots] = k.to(self.k.dtype)
        self.v[layer].flatten(0, 1)[slots] = v.to(self.v.dtype)
