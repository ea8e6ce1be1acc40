"""Next-token sampling over a batch of logits: token, its log-prob and its normalised entropy (the configured
per-token quantity, `stages.rl.entropy.TokenEntropy`; top-k by default, as the reference)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from stages.generation.base import SamplingSpec
from stages.generation.token_entropy import TokenEntropy


def sample_tokens(logits_BV: torch.Tensor, sampling: SamplingSpec,
                  generator: torch.Generator | list[torch.Generator] | None = None,
                  entropy: TokenEntropy | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token_B, logp_B, entropy_B).

    The log-prob and the entropy are those of softmax(logits / T) before top-k / top-p truncation (what the
    trainer recomputes); truncation only shapes the sampling distribution. Greedy picks the argmax. The entropy
    is `entropy` (default: top-10 plus the sampled token, / ln|V|), the quantity every backend reports.
    A list of generators is one per row (requests with their own seeds: a row's draw does not depend on the others).
    """
    scale = sampling.temperature if sampling.temperature > 0 else 1.0
    logp_BV = torch.log_softmax(logits_BV.float() / scale, dim=-1)
    if sampling.greedy:
        tok_B = logits_BV.argmax(-1)
    else:
        scores_BV = logits_BV.float() / sampling.temperature
        if sampling.top_k > 0:
            scores_BV = TopKLogitsWarper(top_k=sampling.top_k)(None, scores_BV)
        if sampling.top_p < 1.0:
            scores_BV = TopPLogitsWarper(top_p=sampling.top_p)(None, scores_BV)
        probs_BV = torch.softmax(scores_BV, dim=-1)
        if isinstance(generator, list):
            tok_B = torch.cat([torch.multinomial(probs_BV[b:b + 1], 1, generator=g)
                               for b, g in enumerate(generator)]).squeeze(-1)
        else:
            tok_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    logp_B = logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
    ent_B = (entropy or TokenEntropy()).from_logp(logp_BV, tok_B)
    return tok_B, logp_B, ent_B
