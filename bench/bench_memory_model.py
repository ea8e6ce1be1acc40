"""The memory model's log-prob pass, measured at reduced size on CPU (docs/plan.md "Memory: checked on CPU").

A random-init Qwen2 with 2 layers, width 64 and the real 151,936-token vocabulary runs, in a fresh process per
case, (a) verl 0.9.1's no-remove-padding old-log-prob computation (the model's [rows, longest, V] logits,
entropy_from_logits, the packed copy, per-row log-softmax: verl/utils/torch_functional.py:173-207, 231-245;
verl/workers/engine/fsdp/transformer_impl.py:1478-1501), and (b) our chunked `token_logprobs`
(stages/rl/logprobs.py). Measured: the process's RSS high-water mark (getrusage) above its RSS just before the pass;
predicted: stages/cost/memory.py's logits and activation terms for the same micro-batch. Prints the ratios.

    .venv/bin/python bench/bench_memory_model.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_result  # noqa: E402
from stages.core.archs import Arch  # noqa: E402
from stages.cost.memory import activation_bytes, logits_bytes  # noqa: E402
from stages.cost.partition import MicroBatch  # noqa: E402

ARCH = Arch(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=151936)
CASES = [  # (dtype, lengths of one micro-batch, path)
    ("float32", (256, 32, 32, 32), "verl"),
    ("bfloat16", (256, 32, 32, 32), "verl"),
    ("bfloat16", (512, 64, 64, 64, 64, 64, 64, 64), "verl"),
    ("float32", (256, 32, 32, 32), "chunked"),
    ("bfloat16", (512, 64, 64, 64, 64, 64, 64, 64), "chunked"),
]

CHILD = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
from transformers import Qwen2Config, Qwen2ForCausalLM
dtype, lengths, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
a = json.loads(sys.argv[4])
cfg = Qwen2Config(hidden_size=a["hidden"], intermediate_size=a["intermediate"], num_hidden_layers=a["layers"],
                  num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"], vocab_size=a["vocab"],
                  tie_word_embeddings=False, attn_implementation="sdpa")
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
B, L = len(lengths), max(lengths)
ids = torch.randint(0, a["vocab"], (B, L))
mask = torch.zeros(B, L, dtype=torch.long)
for b, n in enumerate(lengths):
    mask[b, :n] = 1
with torch.no_grad():
    model(input_ids=ids[:, :4], attention_mask=mask[:, :4])          # warm-up: allocator, kernels

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before, prior_peak = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits                     # [B, L, V]
    if path == "verl":
        pd = torch.nn.functional.softmax(logits, dim=-1)                         # entropy_from_logits
        entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
        del pd
        packed = torch.cat([logits[b, :n] for b, n in enumerate(lengths)])        # narrow + cat: real tokens
        labels = ids[mask.bool()]
        logp = torch.stack([torch.log_softmax(row, -1)[label] for row, label in zip(packed, labels)])  # per row
    else:
        from stages.rl.logprobs import token_logprobs
        logp, entropy = token_logprobs(logits, ids, True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"measured": peak - before, "prior_peak_above": prior_peak - before}))
"""


def predicted(dtype: str, lengths: tuple[int, ...], path: str) -> int:
    mb, c = MicroBatch(lengths), 4 if dtype == "float32" else 2
    acts = activation_bytes(ARCH, mb, c, False, grad=False, checkpointing=True, attn="sdpa")
    if path == "verl":
        return logits_bytes(mb, ARCH.vocab, c, False, "old_log_prob") + acts
    from stages.rl.logprobs import CHUNK
    chunk = min(max(1, CHUNK // len(lengths)) * len(lengths), mb.padded)
    temps = 2 if c == 4 else 3          # one chunk: its float32 copy (none for float32 logits), softmax, softmax * x
    return mb.padded * ARCH.vocab * c + temps * chunk * ARCH.vocab * 4 + acts


def main() -> None:
    arch = json.dumps(vars(ARCH))
    print("| dtype | micro-batch (rows x longest) | path | predicted MiB | measured MiB | measured / predicted |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for dtype, lengths, path in CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, dtype, json.dumps(lengths), path, arch], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        want = predicted(dtype, lengths, path)
        note = "" if got["measured"] > got["prior_peak_above"] else " (peak before the pass was higher)"
        print(f"| {dtype} | {len(lengths)} x {max(lengths)} ({sum(lengths)} real) | {path} | {want / 2**20:,.0f} | "
              f"{got['measured'] / 2**20:,.0f} | {got['measured'] / want:.2f}{note} |", flush=True)
        ratios.append(round(got["measured"] / want, 3))
    write_result("memory_model", {"ratio_min": min(ratios), "ratio_max": max(ratios), "cases": len(ratios),
                                  "ratios": ratios},
                 summary="measured / predicted {ratio_min:.2f}-{ratio_max:.2f} over {cases} cases",
                 what="the memory model's log-prob pass (verl's and our chunked one) at reduced size on CPU: measured "
                      "RSS vs the prediction",
                 command="bench/bench_memory_model.py", details="plan.md#checked-on-cpu",
                 conditions={"cases": [[dtype, lengths, path] for dtype, lengths, path in CASES]})


if __name__ == "__main__":
    main()
