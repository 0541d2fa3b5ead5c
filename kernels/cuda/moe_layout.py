"""Grouping MoE work by expert for the GPU kernels, in plain torch on the device (no host sync).

A *pair* p = t·K + k is token t's k-th routed expert (topk_ids.flatten()[p]). Both layouts list,
per expert, its pairs in ascending pair order (the CPU kernel's sorted_ids grouping: a stable sort of
the flattened topk_ids), so every pair is computed exactly once.

- Contiguous (prefill, variable rows per expert): the pairs sorted by expert, each expert's run
  padded to a multiple of block_m with the sentinel P (= T·K, "no pair"); one expert per row block.
- Masked (decode, fixed shapes for CUDA graphs): S = min(E, P) expert slots, each with its expert
  id, its pair count (0 for unused slots) and up to T pair ids; shapes depend on T, K and E only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ContiguousLayout:
    rows: torch.Tensor  # int32 [num_blocks · block_m]: pair ids sorted by expert, padding = P
    block_expert: torch.Tensor  # int32 [num_blocks]: the expert of each row block (E past the end)
    total_rows: torch.Tensor  # int32 [1]: padded rows in use (blocks at or past it do nothing)
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


@dataclass
class MaskedLayout:
    rows: torch.Tensor  # int32 [S, capacity]: pair ids of each slot's expert (valid below count)
    slot_expert: torch.Tensor  # int32 [S]
    slot_count: torch.Tensor  # int32 [S]: pairs in the slot (0: unused)
    capacity: int  # = T: an expert gets each token at most once

    @property
    def num_slots(self) -> int:
        return self.slot_expert.shape[0]


def _counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert, int64 [E] (scatter_add: bincount would sync with the host on CUDA)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def contiguous_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ContiguousLayout:
    """topk_ids [T, K] → the contiguous layout (row count bounded by P + min(E, P)·(block_m − 1))."""
    flat = topk_ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    counts = _counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, ascending within
    expert_sorted = flat[order]
    rank = torch.arange(p, device=dev) - (counts.cumsum(0) - counts)[expert_sorted]
    dest = (pad_end - padded)[expert_sorted] + rank
    num_blocks = -(-(p + min(num_experts, p) * (block_m - 1)) // block_m)
    rows = torch.full((num_blocks * block_m,), p, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return ContiguousLayout(rows, block_expert, pad_end[-1:].to(torch.int32), block_m)


def masked_layout(topk_ids: torch.Tensor, num_experts: int) -> MaskedLayout:
    """topk_ids [T, K] → the masked layout; ranks come from a one-hot cumsum (P·E work, decode sizes)."""
    t = topk_ids.shape[0]
    flat = topk_ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    slots = min(num_experts, p)
    counts = _counts(flat, num_experts)
    active = counts > 0
    slot_of = active.long().cumsum(0) - 1  # [E]: the slot of each active expert
    target = torch.where(active, slot_of, torch.full_like(slot_of, slots))  # inactive → a dropped slot
    experts = torch.arange(num_experts, device=dev)
    slot_expert = torch.zeros(slots + 1, dtype=torch.int64, device=dev).scatter_(0, target, experts)[:slots]
    slot_count = torch.zeros(slots + 1, dtype=torch.int64, device=dev).scatter_(0, target, counts)[:slots]
    onehot = (flat[:, None] == experts[None, :]).to(torch.int32)  # [P, E] (F.one_hot may sync)
    rank = onehot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
    rows = torch.zeros(slots, max(t, 1), dtype=torch.int32, device=dev)
    rows[slot_of[flat], rank] = torch.arange(p, dtype=torch.int32, device=dev)
    return MaskedLayout(rows, slot_expert.to(torch.int32), slot_count.to(torch.int32), max(t, 1))
