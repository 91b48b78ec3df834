"""Paged KV cache: a block manager (bookkeeping, no tensors) and per-stage cache tensors.

The block manager lives in the engine; it hands out block ids that index the same
logical block on every stage. Each stage allocates physical K/V tensors only for its own
layers: ``num_blocks * block_size`` slots of ``[n_kv_heads, head_dim]`` per layer.
The byte budget covers K and V of all layers of all stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockManager", "KVCache", "blocks_for_budget"]


def blocks_for_budget(budget_bytes: int, bytes_per_token_all_layers: int, block_size: int) -> int:
    """Number of blocks whose K+V over all layers fits in ``budget_bytes``."""
    return int(budget_bytes // (bytes_per_token_all_layers * block_size))


@dataclass
class BlockManager:
    """Allocates fixed-size KV blocks to sequences; never hands out more than it has.

    ``tables[seq]`` lists the blocks of a sequence in order; ``lengths[seq]`` the tokens
    they are sized for. ``peak_used`` records the largest number of blocks ever in use.
    """

    num_blocks: int
    block_size: int
    free_list: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    peak_used: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"the KV budget gives {self.num_blocks} blocks; need at least one")
        self.free_list = list(range(self.num_blocks - 1, -1, -1))

    # -- queries
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.num_used / self.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks needed to hold ``n_tokens`` tokens."""
        return -(-n_tokens // self.block_size)

    def extra_blocks(self, seq: int, n_tokens: int) -> int:
        """Blocks that ``seq`` still needs to hold ``n_tokens`` tokens in total."""
        return max(0, self.blocks_for(n_tokens) - len(self.tables.get(seq, ())))

    def can_grow(self, seq: int, n_tokens: int) -> bool:
        return self.extra_blocks(seq, n_tokens) <= self.num_free

    # -- changes
    def grow(self, seq: int, n_tokens: int) -> list[int]:
        """Make ``seq`` hold ``n_tokens`` tokens; returns its block table.

        Raises ``MemoryError`` if there are not enough free blocks (nothing changes).
        """
        need = self.extra_blocks(seq, n_tokens)
        if need > self.num_free:
            raise MemoryError(f"sequence {seq} needs {need} blocks, {self.num_free} free")
        table = self.tables.setdefault(seq, [])
        for _ in range(need):
            table.append(self.free_list.pop())
        self.lengths[seq] = max(self.lengths.get(seq, 0), n_tokens)
        self.peak_used = max(self.peak_used, self.num_used)
        return table

    def free(self, seq: int) -> None:
        """Return all blocks of ``seq`` (no-op if it has none)."""
        for b in reversed(self.tables.pop(seq, [])):
            self.free_list.append(b)
        self.lengths.pop(seq, None)

    def slots(self, seq: int, start: int, n: int) -> list[int]:
        """KV slots (``block * block_size + offset``) of positions ``start .. start+n-1``."""
        t, bs = self.tables[seq], self.block_size
        return [t[p // bs] * bs + p % bs for p in range(start, start + n)]

    def check(self) -> None:
        """Invariant check: every block is either free or owned by exactly one sequence."""
        owned = [b for t in self.tables.values() for b in t]
        all_ids = owned + self.free_list
        assert len(all_ids) == self.num_blocks == len(set(all_ids)), "block accounting broken"


class KVCache:
    """Physical K/V tensors of one stage: per held layer, ``[slots, n_kv, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype=None,
        device=None,
    ) -> None:
        import torch

        dtype = dtype or torch.float32
        n_slots = num_blocks * block_size
        self.layers = [
            (
                torch.zeros(n_slots, n_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(n_slots, n_kv_heads, head_dim, dtype=dtype, device=device),
            )
            for _ in range(n_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)
