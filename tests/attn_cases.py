"""Paged KV caches for the attention tests: blocks out of order with holes between them, every slot
no sequence owns (holes, the tail of a last block, the block a table's padding points at) NaN, so
a stray read poisons the result. Shape legend: B sequences, NB blocks, BS block size, MB table width.
"""
from __future__ import annotations

import torch


def block_tables(lens: list[int], bs: int, g: torch.Generator) -> tuple[int, torch.Tensor]:
    """(NB, tables [B, MB] int32) for sequences of `lens` keys: blocks drawn at random from twice as
    many as needed; every table has at least one padding entry, pointing at a block nobody owns."""
    need = [-(-n // bs) for n in lens]
    nb = 2 * sum(need) + 2
    free = torch.randperm(nb, generator=g).tolist()
    unused = free.pop()
    width = max(need) + 1
    tables = [[free.pop() for _ in range(k)] for k in need]
    return nb, torch.tensor([t + [unused] * (width - len(t)) for t in tables], dtype=torch.int32)


def slots(table: torch.Tensor, positions: range | list[int], bs: int) -> torch.Tensor:
    """Flat cache slots (block · BS + offset) of one sequence's `positions`; table [MB] → [len] int64."""
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    return table.long()[pos // bs] * bs + pos % bs


def nan_cache(nb: int, bs: int, feat: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full((nb, bs, *feat), float("nan"), dtype=dtype)


def store(cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, start: int = 0) -> None:
    """Write one sequence's rows [n, *feat] at positions start .. start + n − 1 (in place)."""
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots(table, range(start, start + rows.shape[0]), cache.shape[1])] = rows.to(cache.dtype)


def paged(seqs: list[torch.Tensor], bs: int, dtype: torch.dtype, g: torch.Generator,
          tables: tuple[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache [NB, BS, *feat], tables [B, MB]) holding each sequence's rows [n_b, *feat];
    pass `tables` (block_tables' result) to lay out a second cache (V beside K) the same way."""
    nb, bt = tables or block_tables([s.shape[0] for s in seqs], bs, g)
    cache = nan_cache(nb, bs, tuple(seqs[0].shape[1:]), dtype)
    for table, seq in zip(bt, seqs):
        store(cache, table, seq)
    return cache, bt


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN slots included) of two tensors of one dtype."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))
