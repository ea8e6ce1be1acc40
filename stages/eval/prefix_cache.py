"""Prompt-prefix KV caching for the cpu server: the prefill of a shared prefix is computed once.

Evaluation prompts share a long head (chat template + system prompt, ~270 tokens for the TIR prompt) and
an agent loop re-sends its whole text on every continuation call. Without reuse, prefill dominates a CPU
server's time. `PrefixCache` keeps the KV caches of recent prefixes (LRU); a new prefix reuses the longest
common start of any stored one (cropped copy) and computes only the rest. `Engine.generate` gives every row
of a batch the rows' common prefix this way, then pads the differing suffixes between prefix and suffix
(the attention mask hides the pads; position ids follow the mask), as HF's prefix-reuse recipe does.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from transformers import DynamicCache


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, model: Any, max_entries: int = 8, min_tokens: int = 16) -> None:
        self.model = model
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        self.entries: OrderedDict[tuple[int, ...], DynamicCache] = OrderedDict()
        self.hits = 0
        self.reused_tokens = 0
        self.computed_tokens = 0

    def get(self, prefix_ids: list[int]) -> DynamicCache | None:
        """A fresh KV cache holding exactly `prefix_ids` (None when too short or caching is off)."""
        if self.max_entries == 0 or len(prefix_ids) < self.min_tokens:
            return None
        reuse, start = self._best_match(prefix_ids)
        if reuse is not None:
            cache = copy.deepcopy(self.entries[reuse])
            cache.crop(start)
            self.entries.move_to_end(reuse)
            self.hits += 1
        else:
            cache, start = DynamicCache(config=self.model.config), 0
        if start < len(prefix_ids):
            ids_1T = torch.tensor([prefix_ids[start:]], device=self.model.device)
            positions_1T = torch.arange(start, len(prefix_ids), device=self.model.device).unsqueeze(0)
            with torch.inference_mode():
                self.model(input_ids=ids_1T, past_key_values=cache, position_ids=positions_1T, use_cache=True,
                           logits_to_keep=1)
        self.reused_tokens += start
        self.computed_tokens += len(prefix_ids) - start
        self._store(tuple(prefix_ids), cache)
        return copy.deepcopy(cache)

    def _best_match(self, prefix_ids: list[int]) -> tuple[tuple[int, ...] | None, int]:
        best, length = None, 0
        for key in self.entries:
            shared = common_prefix_length(list(key), prefix_ids)
            if shared > length:
                best, length = key, shared
        return (best, length) if length >= self.min_tokens else (None, 0)

    def _store(self, key: tuple[int, ...], cache: DynamicCache) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = copy.deepcopy(cache)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def stats(self) -> dict[str, int]:
        return {"prefix_entries": len(self.entries), "prefix_hits": self.hits,
                "prefix_reused_tokens": self.reused_tokens, "prefix_computed_tokens": self.computed_tokens}
