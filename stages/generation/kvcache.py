"""Per-sequence KV caches and their assembly into one padded batch (transformers backend).

A `SeqCache` holds the keys/values of a sequence's first `len(ids)` context tokens, one (K, V) pair per layer,
each [heads, len, head_dim]. Stored tensors are never written in place: assembling a batch copies them into a
fresh padded tensor, so a fork can share its parent's tensors (a slice view of the first n positions; keys and
values of position t depend only on tokens <= t, so the truncated cache is exact) and the copy happens when the
child's batch is assembled.

Batch layout, row b, with L = max cached length and S = max pending length:
    [ pad ... | cached_b (L_b) ][ pad ... | pending_b (S_b) ] -> decode columns appended on the right
Padding sits inside the sequence; a boolean `valid_BK` marks real columns, positions ids carry the real positions
(RoPE), and the 4D attention mask lets every query see the valid columns at or before it, plus itself (so a
padding query never has an all-masked row, which would produce NaN that leaks through 0 * NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class SeqCache:
    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    def __len__(self) -> int:
        return len(self.ids)

    def truncated(self, n: int) -> SeqCache:
        n = max(0, min(n, len(self.ids)))
        if n == len(self.ids):
            return SeqCache(list(self.ids), self.kv)
        return SeqCache(self.ids[:n], [(k[:, :n], v[:, :n]) for k, v in self.kv])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Batch:
    input_ids_BS: torch.Tensor
    position_ids_BS: torch.Tensor
    valid_BK: torch.Tensor          # K = L + S columns so far
    cache: DynamicCache
    n_real_B: torch.Tensor          # real tokens fed per row (= next position id)


def assemble(caches: list[SeqCache | None], pending: list[list[int]], pad_id: int,
             device: torch.device) -> Batch:
    """Pad per-row caches and pending tokens into one batch (see the module docstring for the layout)."""
    lens = [len(c) if c is not None else 0 for c in caches]
    L, S, B = max(lens), max(len(p) for p in pending), len(pending)
    valid = torch.zeros(B, L + S, dtype=torch.bool, device=device)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros(B, S, dtype=torch.long, device=device)
    for b, (l_b, p_b) in enumerate(zip(lens, pending)):
        valid[b, L - l_b:L] = True
        valid[b, L + S - len(p_b):] = True
        input_ids[b, S - len(p_b):] = torch.tensor(p_b, dtype=torch.long, device=device)
        positions[b, S - len(p_b):] = torch.arange(l_b, l_b + len(p_b), device=device)
    cache = DynamicCache()
    if L > 0:
        ref = next(c for c in caches if c is not None and len(c))
        layers = []
        for layer, (k0, v0) in enumerate(ref.kv):
            k = k0.new_zeros(B, k0.shape[0], L, k0.shape[2])
            v = v0.new_zeros(B, v0.shape[0], L, v0.shape[2])
            for b, c in enumerate(caches):
                if c is not None and len(c):
                    k[b, :, L - len(c):] = c.kv[layer][0]
                    v[b, :, L - len(c):] = c.kv[layer][1]
            layers.append((k, v))
        cache = DynamicCache(ddp_cache_data=layers)
    n_real = torch.tensor([l_b + len(p_b) for l_b, p_b in zip(lens, pending)], device=device)
    return Batch(input_ids, positions, valid, cache, n_real)


def attention_mask_4d(valid_BK: torch.Tensor, q_len: int, additive_dtype: torch.dtype | None) -> torch.Tensor:
    """[B, 1, q_len, K] mask for the last q_len columns as queries: causal over valid columns, plus the diagonal.

    Boolean (True = attend) for sdpa; additive (0 / dtype min) when `additive_dtype` is given (eager).
    """
    K = valid_BK.shape[1]
    k_idx = torch.arange(K, device=valid_BK.device)
    q_idx = k_idx[K - q_len:]
    causal_QK = k_idx[None, :] <= q_idx[:, None]
    diag_QK = k_idx[None, :] == q_idx[:, None]
    allowed = (valid_BK[:, None, None, :] & causal_QK[None, None]) | diag_QK[None, None]
    if additive_dtype is None:
        return allowed
    zero = torch.zeros((), dtype=additive_dtype, device=valid_BK.device)
    return torch.where(allowed, zero, torch.finfo(additive_dtype).min)


def extract(cache: DynamicCache, row: int, valid_K: torch.Tensor, ids: list[int]) -> SeqCache:
    """Copy row `row`'s valid columns out of a batched cache."""
    idx = valid_K.nonzero().squeeze(-1)
    if idx.numel() != len(ids):
        raise RuntimeError(f"cache row {row} holds {idx.numel()} valid positions but {len(ids)} context tokens; "
                           "this is a bug in the batch bookkeeping")
    kv = [(layer.keys[row].index_select(1, idx), layer.values[row].index_select(1, idx)) for layer in cache.layers]
    return SeqCache(list(ids), kv)
