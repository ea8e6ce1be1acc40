"""The pinned verl's dynamic-batching micro-batch partition, re-computed without verl (docs/plan.md "Memory").

`rearrange_micro_batches` (verl/utils/seqlen_balancing.py:348-504) splits one GPU's sequences into
`ceil(total tokens / budget)` micro-batches (at most one per sequence), balanced by the attention workload
`24576 L + L^2` (:27-46) with the Karmarkar-Karp differencing method (:49-172), and adds one micro-batch until every
micro-batch's *real* token count fits the budget (:441-460). Without remove-padding the FSDP engine then pads each
micro-batch to its longest sequence (verl/workers/engine/fsdp/transformer_impl.py:1277-1289): the tensors it
materialises are `count x longest`, which the budget never sees. `micro_batches` returns both numbers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


def workload(length: int) -> int:
    """verl's calculate_workload (seqlen_balancing.py:46)."""
    return 24576 * length + length * length


class _Set:
    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, int]] = []

    def add(self, idx: int, val: int) -> None:
        self.items.append((idx, val))
        self.sum += val

    def __lt__(self, other: _Set) -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for i, (idx, val) in enumerate(items):
            self.sets[i].add(idx, val)
        self.sets.sort(reverse=True)

    def merge(self, other: _State) -> None:
        for i in range(self.k):
            for idx, val in other.sets[self.k - 1 - i].items:
                self.sets[i].add(idx, val)
        self.sets.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _State) -> bool:   # the largest spread pops first (seqlen_balancing.py:122-128)
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def karmarkar_karp(values: list[int], k: int) -> list[list[int]]:
    """Indices of `values` in k partitions of near-equal sums (seqlen_balancing.py:49-172, equal_size=False)."""
    heap: list[_State] = []
    for val, idx in sorted((v, i) for i, v in enumerate(values)):
        heapq.heappush(heap, _State([(idx, val)], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [sorted(idx for idx, _ in s.items) for s in heap[0].sets]


@dataclass(frozen=True)
class MicroBatch:
    lengths: tuple[int, ...]

    @property
    def real(self) -> int:
        """Tokens the budget counts (the attention mask's sum)."""
        return sum(self.lengths)

    @property
    def padded(self) -> int:
        """Tokens materialised without remove-padding: every row padded to the longest."""
        return len(self.lengths) * max(self.lengths)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)


def micro_batches(lengths: list[int], budget: int) -> list[MicroBatch]:
    """One GPU's sequences (prompt + response tokens each) in verl's dynamic micro-batches of `budget` tokens.
    verl asserts that the budget holds the longest sequence (seqlen_balancing.py:384)."""
    if not lengths:
        return []
    if budget < max(lengths):
        raise ValueError(f"a token budget of {budget} cannot hold a {max(lengths)}-token sequence (verl asserts "
                         "max_token_len >= the sequence length)")
    count = min(len(lengths), -(-sum(lengths) // budget))
    loads = [workload(n) for n in lengths]
    while True:
        parts = karmarkar_karp(loads, count)
        if all(sum(lengths[i] for i in part) <= budget for part in parts):
            return [MicroBatch(tuple(lengths[i] for i in part)) for part in parts]
        count += 1


def fixed_micro_batches(lengths: list[int], size: int) -> list[MicroBatch]:
    """Fixed micro-batches of `size` sequences in order (no dynamic batching)."""
    return [MicroBatch(tuple(lengths[i:i + size])) for i in range(0, len(lengths), size)]
