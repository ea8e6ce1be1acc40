"""The parity probe: log-probs of fixed token sequences, recorded by the trainer and re-measured after a merge.

A merged model that differs from the trained one (a lost tensor, a wrong transpose, a bad dtype cast, a LoRA
scale applied twice) moves these numbers; `max_abs_diff` is the evidence the merge stage reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stages.core.atomic import write_json
from stages.generation.types import Trajectory
from stages.rl.logprobs import collate, policy_forward

PROBE_FILE = "probe.json"
PROBE_TEXTS = (
    ("<think>17 times 23: let me compute it.</think><python>print(17 * 23)</python> <result>\n391\n</result>"
     "<think>The tool says 391.</think><answer>The answer is \\boxed{391}</answer>"),
    ("<think>Who wrote the novel?</think><search>author of War and Peace</search> <result>\nPage 1: War and "
     "Peace is a novel by Leo Tolstoy.\n</result><answer>\\boxed{Leo Tolstoy}</answer>"),
    "The capital of France is Paris. 2 + 3 = 5.",
)


def probe_sequences(tokenizer: Any, texts: tuple[str, ...] = PROBE_TEXTS) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, sequences: list[list[int]], device: torch.device | None = None
                   ) -> list[list[float]]:
    """log p(token_t | tokens_<t) for t >= 1 of every sequence, in float32, model in eval mode."""
    device = device or next(model.parameters()).device
    trajs = [Trajectory(traj_id=i, group=0, prompt_ids=ids[:1], response_ids=ids[1:], loss_mask=[1] * (len(ids) - 1))
             for i, ids in enumerate(sequences)]
    was_training = model.training
    model.eval()
    try:
        batch = collate(trajs, pad_id=0).to(device)
        logp_BT, _ = policy_forward(model, batch)
    finally:
        model.train(was_training)
    return [logp_BT[i, :len(ids) - 1].float().cpu().tolist() for i, ids in enumerate(sequences)]


def write_probe(folder: Path, model: torch.nn.Module, tokenizer: Any) -> Path:
    """Record the probe with the model where it is; the device type is kept so the merge measures on the same
    kind of device (CPU and GPU kernels differ in the last digits)."""
    sequences = probe_sequences(tokenizer)
    device = next(model.parameters()).device
    return write_json(Path(folder) / PROBE_FILE, {"sequences": sequences, "device": device.type,
                                                  "logprobs": probe_logprobs(model, sequences)}, indent=None)


def read_probe(folder: Path) -> dict[str, list[list[Any]]]:
    path = Path(folder) / PROBE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the trainer writes it with the final checkpoint; re-run RL")
    return json.loads(path.read_text())


def max_abs_diff(expected: list[list[float]], actual: list[list[float]]) -> float:
    if [len(x) for x in expected] != [len(x) for x in actual]:
        raise ValueError("probe shapes differ: the merged model was probed on other sequences")
    return max((abs(a - b) for xs, ys in zip(expected, actual) for a, b in zip(xs, ys)), default=0.0)
