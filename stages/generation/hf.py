"""Transformers generation backend with per-sequence KV-cache reuse (CPU or GPU), on the trainer's own model.

One `generate` call = one batched prefill of every request's uncached tokens, then lock-step decoding of all
rows; a row leaves the batch when it samples EOS, completes a stop string or spends its `max_new_tokens`, and
its cache (everything fed so far: context + new tokens except the last sampled one) is kept under its key.

`kv_reuse=True`: a sequence's cache persists across rounds (after a tool result only the result tokens and the
last sampled token are prefilled), `fork` starts a branch from its parent's cache and `prefill` shares one
prompt pass between all roots of a group. `kv_reuse=False` is the plain path: every call re-prefills the full
context and no cache outlives a call. `stats` counts the forward tokens of both modes the same way.

The model is used as given (weights updated in place by the trainer between steps), under `torch.no_grad()`
in eval mode (restored afterwards). Only full-attention decoders with the sdpa or eager attention path are
supported (the backend builds its own 4D mask for padded caches).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from stages.agent.stops import StopMatcher
from stages.core.log import get_logger
from stages.generation.base import (
    AnswersOneByOne,
    ForwardStats,
    GenRequest,
    GenResult,
    SamplingSpec,
    eos_ids_of,
    request_seed,
)
from stages.generation.kvcache import (
    Batch,
    SeqCache,
    assemble,
    attention_mask_4d,
    common_prefix,
    extract,
)
from stages.generation.sampling import sample_tokens
from stages.generation.token_entropy import TokenEntropy

log = get_logger(__name__)

SUPPORTED_ATTENTION = ("sdpa", "eager")


@contextmanager
def _inference(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def check_model(model: torch.nn.Module) -> None:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn not in SUPPORTED_ATTENTION:
        raise ValueError(f"the transformers rollout backend needs attn_implementation in {SUPPORTED_ATTENTION}, "
                         f"the model uses {attn!r}; load it with attn_implementation='sdpa' or use the vllm backend")
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"the transformers rollout backend supports full-attention decoders only; this model has "
                         f"layer types {sorted(layer_types)}; use the vllm backend for it")


class TransformersBackend(AnswersOneByOne):
    name = "transformers"

    def __init__(self, model: torch.nn.Module, tokenizer, *, kv_reuse: bool = True,
                 max_batch_size: int | None = None, entropy: TokenEntropy | None = None) -> None:
        check_model(model)
        self.model, self.tokenizer = model, tokenizer
        self.entropy = entropy or TokenEntropy()
        self.kv_reuse = kv_reuse
        self.max_batch_size = max_batch_size
        self.vocab_size = min(len(tokenizer), int(model.get_output_embeddings().weight.shape[0]))
        self.eos_token_ids = eos_ids_of(tokenizer, getattr(model, "generation_config", None))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_token_ids)
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        self._additive = None if attn == "sdpa" else model.dtype
        self.stats = ForwardStats()
        self._caches: dict[Hashable, SeqCache] = {}

    def refresh_weights(self) -> None:
        """No-op: the backend samples from the trainer's model object, updated in place. Caches of old weights
        must not survive a step; the tool rollout calls `release()` after every rollout."""

    # ---- cache management ---------------------------------------------------------------------------------
    def fork(self, src: Hashable, dst: Hashable, n_tokens: int) -> None:
        """`dst` starts from the first `n_tokens` context tokens of `src`'s cache (shared, no recompute)."""
        if self.kv_reuse and src in self._caches:
            self._caches[dst] = self._caches[src].truncated(n_tokens)

    def release(self, keys: Iterable[Hashable] | None = None) -> None:
        if keys is None:
            self._caches.clear()
        else:
            for key in keys:
                self._caches.pop(key, None)

    def cached_tokens(self, key: Hashable) -> int:
        return len(self._caches[key]) if key in self._caches else 0

    def prefill(self, items: Sequence[tuple[Hashable, list[int]]]) -> None:
        """Compute and keep the cache of each context minus its last token (the next call feeds that one)."""
        if not self.kv_reuse:
            return
        todo = [(key, ids) for key, ids in items if len(ids) > 1]
        for chunk in self._chunks(todo):
            with _inference(self.model):
                caches = [self._reusable(key, ids) for key, ids in chunk]
                pending = [ids[len(c) if c else 0:-1] for (key, ids), c in zip(chunk, caches)]
                rows = [i for i, p in enumerate(pending) if p]
                if not rows:
                    continue
                batch, _ = self._prefill([caches[i] for i in rows], [pending[i] for i in rows])
                for j, i in enumerate(rows):
                    key, ids = chunk[i]
                    self._caches[key] = extract(batch.cache, j, batch.valid_BK[j], ids[:-1])

    # ---- generation ---------------------------------------------------------------------------------------
    def generate_iter(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                      seed: int | None = None) -> Iterator[tuple[int, GenResult]]:
        """(index, result) of each request as its row finishes decoding (the `early_tools` schedule starts its tool
        call there while the other rows decode on); the same tokens as `generate`, whatever the caller does
        between rows."""
        generator: torch.Generator | list[torch.Generator] | None = None
        if not sampling.greedy:
            base = seed if seed is not None else torch.seed()
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(base)
            if any(r.seed is not None for r in requests):  # requests with their own seeds: a generator per row
                generator = [torch.Generator(device=self.model.device).manual_seed(request_seed(r, base, i) % 2**63)
                             for i, r in enumerate(requests)]
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("two requests of one generate call share a cache key; give every sequence its own key")
        offset = 0
        for chunk in self._chunks(list(requests)):
            rows = generator[offset:offset + len(chunk)] if isinstance(generator, list) else generator
            with _inference(self.model):
                for i, res in self._generate(chunk, sampling, rows):
                    yield offset + i, res
            offset += len(chunk)
        if not self.kv_reuse:
            self._caches.clear()

    def _chunks(self, items: list) -> Iterable[list]:
        size = self.max_batch_size or max(1, len(items))
        for i in range(0, len(items), size):
            yield items[i:i + size]

    def _reusable(self, key: Hashable, ids: list[int]) -> SeqCache | None:
        """The key's cache truncated to its longest prefix of `ids`, leaving at least one token to feed."""
        cache = self._caches.get(key) if self.kv_reuse else None
        if cache is None:
            return None
        keep = min(common_prefix(cache.ids, ids), len(ids) - 1)
        return cache.truncated(keep) if keep else None

    def _forward(self, batch: Batch) -> torch.Tensor:
        """Feed batch.input_ids_BS; return the next-token logits of the last column [B, V]."""
        mask = attention_mask_4d(batch.valid_BK, batch.input_ids_BS.shape[1], self._additive)
        out = self.model(input_ids=batch.input_ids_BS, attention_mask=mask, position_ids=batch.position_ids_BS,
                         past_key_values=batch.cache, use_cache=True, logits_to_keep=1)
        self.stats.forward_calls += 1
        self.stats.padded_tokens += batch.input_ids_BS.numel()
        return out.logits[:, -1, :self.vocab_size]

    def _prefill(self, caches: list[SeqCache | None], pending: list[list[int]]) -> tuple[Batch, torch.Tensor]:
        batch = assemble(caches, pending, self.pad_id, self.model.device)
        self.stats.prefill_tokens += sum(len(p) for p in pending)
        self.stats.reused_tokens += sum(len(c) for c in caches if c is not None)
        return batch, self._forward(batch)

    def _generate(self, requests: list[GenRequest], sampling: SamplingSpec,
                  generator: torch.Generator | list[torch.Generator] | None) -> Iterator[tuple[int, GenResult]]:
        caches = [self._reusable(r.key, r.token_ids) for r in requests]
        pending = [r.token_ids[len(c) if c else 0:] for r, c in zip(requests, caches)]
        batch, logits_BV = self._prefill(caches, pending)
        matcher = StopMatcher(self.tokenizer, sampling.stop)
        out = [GenResult([], [], [], "length") for _ in requests]
        rows = list(range(len(requests)))  # batch row -> request index
        while rows:
            row_gen = [generator[i] for i in rows] if isinstance(generator, list) else generator
            tok_B, logp_B, ent_B = sample_tokens(logits_BV, sampling, row_gen, self.entropy)
            keep: list[int] = []
            for b, i in enumerate(rows):
                res, tok = out[i], int(tok_B[b])
                res.token_ids.append(tok)
                res.logprobs.append(float(logp_B[b]))
                res.entropies.append(float(ent_B[b]))
                if tok in self.eos_token_ids:
                    res.finish_reason = "eos"
                elif (stop := matcher.match(res.token_ids)) is not None:
                    res.finish_reason, res.stop = "stop", stop
                elif len(res.token_ids) >= requests[i].max_new_tokens:
                    res.finish_reason = "length"
                else:
                    keep.append(b)
                    continue
                if self.kv_reuse:
                    fed = requests[i].token_ids + res.token_ids[:-1]
                    self._caches[requests[i].key] = extract(batch.cache, b, batch.valid_BK[b], fed)
                yield i, res
            if not keep:
                break
            logits_BV = self._decode_step(batch, keep, tok_B)
            rows = [rows[b] for b in keep]

    def _decode_step(self, batch: Batch, keep: list[int], tok_B: torch.Tensor) -> torch.Tensor:
        """Drop finished rows, feed each remaining row its last sampled token, return the next logits."""
        if len(keep) < batch.valid_BK.shape[0]:
            idx = torch.tensor(keep, device=batch.valid_BK.device)
            batch.cache.batch_select_indices(idx)
            batch.valid_BK, batch.n_real_B, tok_B = batch.valid_BK[idx], batch.n_real_B[idx], tok_B[idx]
        ones = torch.ones(len(keep), 1, dtype=torch.bool, device=batch.valid_BK.device)
        batch.valid_BK = torch.cat([batch.valid_BK, ones], dim=1)
        batch.input_ids_BS = tok_B[:, None]
        batch.position_ids_BS = batch.n_real_B[:, None].clone()
        batch.n_real_B = batch.n_real_B + 1
        self.stats.decode_tokens += len(keep)
        return self._forward(batch)
