"""Trajectories -> padded tensors, and per-token log-probs / entropies from one forward pass over prompt+response.

Layout (verl's): prompts left-padded to the widest prompt P, responses right-padded to the longest response T, so
every response starts at column P and response position t is column P + t in every row:

    row b: [pad ... pad | prompt_b ][ response_b | pad ... pad ]
            <------- P ----------->  <---------- T ---------->

The logits at columns P-1 .. P+T-2 predict response tokens 0 .. T-1; only those T columns are projected onto
the vocabulary (`logits_to_keep`), which keeps memory at B*T*V rather than B*(P+T)*V.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache

from stages.generation.types import Trajectory


@dataclass
class Collated:
    input_ids_BL: torch.Tensor        # long, L = P + T
    attention_mask_BL: torch.Tensor   # long, 1 on real tokens
    position_ids_BL: torch.Tensor     # long, 0.. along real tokens (left padding shifts them)
    response_ids_BT: torch.Tensor     # long, pad id after the response
    valid_BT: torch.Tensor            # bool, response token exists
    mask_BT: torch.Tensor             # float, loss mask (1 = sampled by the policy, 0 = tool result / padding)
    prompt_width: int                 # P

    @property
    def rows(self) -> int:
        return self.input_ids_BL.shape[0]

    @property
    def width(self) -> int:
        return self.response_ids_BT.shape[1]

    def to(self, device: torch.device) -> Collated:
        return Collated(self.input_ids_BL.to(device), self.attention_mask_BL.to(device),
                        self.position_ids_BL.to(device), self.response_ids_BT.to(device), self.valid_BT.to(device),
                        self.mask_BT.to(device), self.prompt_width)

    def rows_slice(self, start: int, stop: int) -> Collated:
        """Rows [start, stop), keeping the batch-wide P and T (so column t means the same thing everywhere)."""
        return Collated(self.input_ids_BL[start:stop], self.attention_mask_BL[start:stop],
                        self.position_ids_BL[start:stop], self.response_ids_BT[start:stop],
                        self.valid_BT[start:stop], self.mask_BT[start:stop], self.prompt_width)


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> Collated:
    """Pad a list of trajectories into the layout above. Responses must be non-empty."""
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    for traj in trajectories:
        if not traj.prompt_ids:
            raise ValueError(f"trajectory {traj.traj_id} has no prompt tokens")
        if len(traj.loss_mask) != len(traj.response_ids):
            raise ValueError(f"trajectory {traj.traj_id}: {len(traj.response_ids)} response tokens but "
                             f"{len(traj.loss_mask)} loss-mask entries; the rollout must give one per token")
    P = max(len(t.prompt_ids) for t in trajectories)
    T = max(1, max(len(t.response_ids) for t in trajectories))
    B = len(trajectories)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for b, traj in enumerate(trajectories):
        p, r = len(traj.prompt_ids), len(traj.response_ids)
        input_ids[b, P - p:P] = torch.tensor(traj.prompt_ids, dtype=torch.long)
        attention[b, P - p:P + r] = 1
        if r:
            input_ids[b, P:P + r] = torch.tensor(traj.response_ids, dtype=torch.long)
            mask[b, :r] = torch.tensor(traj.loss_mask, dtype=torch.float32)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    valid = attention[:, P:].bool()
    return Collated(input_ids, attention, positions, input_ids[:, P:].clone(), valid, mask * valid, P)


CHUNK = 256  # tokens (rows x positions) per float32 chunk: each full-vocabulary temporary is 256 x V x 4 bytes
            # (156 MB at Qwen's 151,936), whatever the batch


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, with_entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] and the full-vocabulary entropy / ln|V| per position (float32).

    Computed in chunks of positions, with and without autograd (`ChunkedLogprobs`): beside the logits themselves
    (and, in backward, their gradient) no tensor of tokens x vocabulary is ever held."""
    logp_BT, entropy_BT = ChunkedLogprobs.apply(logits_BTV, targets_BT, with_entropy)
    return logp_BT, entropy_BT if with_entropy else None


def _positions(logits_BTV: torch.Tensor) -> int:
    return max(1, CHUNK // max(1, logits_BTV.shape[0]))


def _token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, with_entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unchunked formula (float32 copies of the whole [B, T, V]): the reference the chunked one is tested on."""
    logits_BTV = logits_BTV.float()
    lse_BT = torch.logsumexp(logits_BTV, dim=-1)
    logp_BT = logits_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1) - lse_BT
    if not with_entropy:
        return logp_BT, None
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return logp_BT, (lse_BT - (probs_BTV * logits_BTV).sum(-1)) / math.log(logits_BTV.shape[-1])


class ChunkedLogprobs(torch.autograd.Function):
    """Per-position log p(target) and entropy / ln|V| from logits [B, T, V], chunk by chunk over positions.

    Forward keeps only the per-position logsumexp (and entropy) for backward; backward recomputes each chunk's
    softmax p and writes d/dx = g_logp (onehot(target) - p) - g_H / ln|V| * p (log p + H), the derivative of
    log p_y = x_y - lse and of H = -sum p log p (dH/dx_j = -p_j (log p_j + H))."""

    @staticmethod
    def forward(ctx, logits_BTV: torch.Tensor, targets_BT: torch.Tensor, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, V = logits_BTV.shape
        step = _positions(logits_BTV)
        lse_BT = logits_BTV.new_empty((B, T), dtype=torch.float32)
        logp_BT = torch.empty_like(lse_BT)
        entropy_BT = torch.zeros_like(lse_BT)
        for i in range(0, T, step):
            x = logits_BTV[:, i:i + step].float()
            lse = torch.logsumexp(x, dim=-1)
            lse_BT[:, i:i + step] = lse
            logp_BT[:, i:i + step] = x.gather(-1, targets_BT[:, i:i + step].unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:
                entropy_BT[:, i:i + step] = (lse - (torch.softmax(x, dim=-1) * x).sum(-1)) / math.log(V)
        ctx.with_entropy = with_entropy
        ctx.save_for_backward(logits_BTV, targets_BT, lse_BT, entropy_BT)
        return logp_BT, entropy_BT

    @staticmethod
    def backward(ctx, g_logp_BT: torch.Tensor, g_entropy_BT: torch.Tensor | None):  # type: ignore[override]
        logits_BTV, targets_BT, lse_BT, entropy_BT = ctx.saved_tensors
        B, T, V = logits_BTV.shape
        step, log_v = _positions(logits_BTV), math.log(V)
        grad_BTV = torch.empty_like(logits_BTV)
        for i in range(0, T, step):
            logp = logits_BTV[:, i:i + step].float() - lse_BT[:, i:i + step, None]
            p = logp.exp()
            g = p * -g_logp_BT[:, i:i + step, None]
            g.scatter_add_(-1, targets_BT[:, i:i + step, None], g_logp_BT[:, i:i + step, None])
            if ctx.with_entropy and g_entropy_BT is not None:
                h = entropy_BT[:, i:i + step, None] * log_v
                g -= (g_entropy_BT[:, i:i + step, None] / log_v) * p * (logp + h)
            grad_BTV[:, i:i + step] = g
        return grad_BTV, None, None


def policy_forward(model: torch.nn.Module, batch: Collated, temperature: float = 1.0,
                   with_entropy: bool = False, shared_prompt: bool = False,
                   detach_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens under softmax(logits / T), zero outside the response.

    Uses the sampling temperature so the values match what the rollout recorded (T <= 0, greedy, counts as 1).
    `shared_prompt`: rows with the same prompt share one prompt pass (`response_logits`); `detach_entropy`:
    entropies without gradient (for metrics), computed in chunks outside autograd.
    """
    T = batch.width
    logits_BTV = response_logits(model, batch) if shared_prompt else None
    if logits_BTV is None:
        out = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                    position_ids=batch.position_ids_BL, logits_to_keep=T + 1, use_cache=False)
        logits_BTV = out.logits[:, :T]
    if temperature > 0 and temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logp_BT, entropy_BT = token_logprobs(logits_BTV, batch.response_ids_BT, with_entropy and not detach_entropy)
    if with_entropy and detach_entropy:
        with torch.no_grad():
            entropy_BT = token_logprobs(logits_BTV.detach(), batch.response_ids_BT, True)[1]
    logp_BT = torch.where(batch.valid_BT, logp_BT, torch.zeros_like(logp_BT))
    if entropy_BT is not None:
        entropy_BT = torch.where(batch.valid_BT, entropy_BT, torch.zeros_like(entropy_BT))
    return logp_BT, entropy_BT


def response_logits(model: torch.nn.Module, batch: Collated) -> torch.Tensor | None:
    """The response columns' logits [B, T, V] with each distinct prompt computed once, or None when no two rows
    share a prompt (or the prompt is a single token, or activation checkpointing is on, which turns the cache off).

    Pass 1 runs the distinct prompts minus their last token (left-padded, so the last token sits in column P-1 of
    every row) and keeps their KV cache. Then each row runs [last prompt token, its response tokens but the last]
    over its prompt's cache, unpadded (on a CPU a row's matmuls are as efficient as a padded batch's, and the
    padding is not computed), so its outputs predict its response tokens -- the columns `policy_forward` keeps; the
    rows are padded to T afterwards (logits 0 there; those positions are masked). Keys and values of a position
    depend only on the tokens up to it, so the numbers are those of the full forward (to float rounding) and so is
    the gradient: d loss / d prompt KV is the sum over the rows that read it.
    """
    P, T = batch.prompt_width, batch.width
    if P < 2 or getattr(model, "is_gradient_checkpointing", False):
        return None
    prompts = [tuple(row) for row in batch.input_ids_BL[:, :P].tolist()]
    first: dict[tuple[int, ...], int] = {}
    index_B = [first.setdefault(p, len(first)) for p in prompts]
    if len(first) == len(prompts):
        return None
    rows_U = torch.tensor([prompts.index(p) for p in first], device=batch.input_ids_BL.device)
    out = model(input_ids=batch.input_ids_BL[rows_U, :P - 1], attention_mask=batch.attention_mask_BL[rows_U, :P - 1],
                position_ids=batch.position_ids_BL[rows_U, :P - 1], use_cache=True, logits_to_keep=1)
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    lengths = batch.valid_BT.sum(dim=1).clamp(min=1).tolist()
    rows = []
    for b, (u, n) in enumerate(zip(index_B, lengths)):
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(layers):
            cache.update(k[u:u + 1], v[u:u + 1], i)
        cols = slice(P - 1, P - 1 + n)
        rows.append(model(input_ids=batch.input_ids_BL[b:b + 1, cols],
                          attention_mask=batch.attention_mask_BL[b:b + 1, :P - 1 + n],
                          position_ids=batch.position_ids_BL[b:b + 1, cols], past_key_values=cache, use_cache=True,
                          logits_to_keep=n).logits[0])
    logits_BTV = pad_sequence(rows, batch_first=True)
    return torch.nn.functional.pad(logits_BTV, (0, 0, 0, T - logits_BTV.shape[1]))


@torch.no_grad()
def batched_forward(model: torch.nn.Module, batch: Collated, micro_batch_size: int, temperature: float,
                    with_entropy: bool, device: torch.device, shared_prompt: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`policy_forward` without gradient over micro-batches; results on CPU, [B, T]."""
    logps, entropies = [], []
    for start in range(0, batch.rows, micro_batch_size):
        micro = batch.rows_slice(start, start + micro_batch_size).to(device)
        logp, entropy = policy_forward(model, micro, temperature, with_entropy, shared_prompt)
        logps.append(logp.float().cpu())
        if entropy is not None:
            entropies.append(entropy.float().cpu())
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)
