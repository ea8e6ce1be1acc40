"""Result-token masking: no SFT loss on the text the environment inserted (` <result>\\n...\\n</result>`).

LLaMA-Factory trains on the whole assistant turn, tool results included (the reference behaviour, ARPO issue
#9). With `sft.mask_tool_results` we let LLaMA-Factory tokenize the dataset exactly as it would for training
(its own template and cutoff, saved with `tokenized_path`), then set label -100 on every assistant token whose
characters overlap a result span, and save the result where training loads it: given a non-empty
`tokenized_path`, LLaMA-Factory 0.9.5 loads it with `load_from_disk` and skips its own preprocessing
(`llamafactory.data.loader.get_dataset`).

Run as `python -m stages.sft.masking <args.yaml> <tokenized_dir>` so LLaMA-Factory's argument parser and its
global logging setup stay out of the calling process.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from stages.core.atomic import atomic_path, write_json

IGNORE_INDEX = -100  # llamafactory.extras.constants.IGNORE_INDEX, the label HF losses skip
RESULT_SPAN = re.compile(r"[ \t]?<result>.*?(?:</result>|\Z)", re.DOTALL)  # unterminated = cut off by cutoff_len
STATS_FILE = "mask_stats.json"
_COUNTS = ("tokens", "trained_tokens_before", "masked_tokens")  # per-row counters summed into the stats


def result_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of tool results, each with the single space the protocol puts before it."""
    return [m.span() for m in RESULT_SPAN.finditer(text)]


def overlapping_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose character range [a, b) overlaps one of the spans."""
    return [any(a < end and start < b for start, end in spans) for a, b in offsets]


def label_runs(labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of trained (label != -100) positions: one per assistant turn."""
    runs, start = [], None
    for i, label in enumerate(labels):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(labels)))
    return runs


def token_offsets(tokenizer: Any, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of `ids` and each token's character range in it.

    Re-encoding the decoded text gives the same ids for every token LLaMA-Factory encoded whole; a sequence cut
    by cutoff_len can differ in its last tokens, which are then measured by decoding prefixes.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    same = 0
    for mine, theirs in zip(ids, encoded["input_ids"]):
        if mine != theirs:
            break
        same += 1
    offsets = [tuple(pair) for pair in encoded["offset_mapping"][:same]]
    position = offsets[-1][1] if offsets else 0
    for end in range(same + 1, len(ids) + 1):
        stop = len(tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        offsets.append((position, stop))
        position = stop
    return text, offsets


def mask_results(tokenizer: Any, input_ids: list[int], labels: list[int]) -> tuple[list[int], int]:
    """Labels with -100 on result tokens, and how many trained tokens were masked."""
    out = list(labels)
    masked = 0
    for start, end in label_runs(labels):
        text, offsets = token_offsets(tokenizer, input_ids[start:end])
        for i, hit in enumerate(overlapping_tokens(offsets, result_spans(text))):
            if hit:
                out[start + i] = IGNORE_INDEX
                masked += 1
    return out, masked


def _mask_batch(batch: dict[str, list], tokenizer: Any) -> dict[str, list]:
    out: dict[str, list] = {"labels": [], **{name: [] for name in _COUNTS}}
    for ids, row_labels in zip(batch["input_ids"], batch["labels"]):
        new, count = mask_results(tokenizer, ids, row_labels)
        out["labels"].append(new)
        out["tokens"].append(len(ids))
        out["trained_tokens_before"].append(sum(1 for v in row_labels if v != IGNORE_INDEX))
        out["masked_tokens"].append(count)
    return out


def pretokenize(args: dict[str, Any], tokenized_path: str | Path, num_proc: int = 1) -> dict[str, Any]:
    """Tokenize with LLaMA-Factory (same args as training), mask result labels, save to `tokenized_path`."""
    from datasets import load_from_disk
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    target = Path(tokenized_path)
    raw = target.with_name(target.name + ".unmasked")
    shutil.rmtree(raw, ignore_errors=True)
    prep = {k: v for k, v in args.items() if k not in ("deepspeed", "resume_from_checkpoint")}
    prep |= {"tokenized_path": str(raw), "bf16": False, "fp16": False, "output_dir": str(raw) + ".trainer"}
    model_args, data_args, training_args, _, _ = get_train_args(prep)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    tokenizer = tokenizer_module["tokenizer"]
    data = load_from_disk(str(raw))
    masked = data.map(_mask_batch, batched=True, fn_kwargs={"tokenizer": tokenizer}, num_proc=num_proc,
                      desc="Masking tool results")
    train = masked["train"]
    stats = {"rows": len(train), **{name: int(sum(train[name])) for name in _COUNTS}}
    stats["trained_tokens_after"] = stats["trained_tokens_before"] - stats["masked_tokens"]
    with atomic_path(target) as tmp:
        masked.remove_columns(list(_COUNTS)).save_to_disk(str(tmp))
    shutil.rmtree(raw, ignore_errors=True)
    shutil.rmtree(str(raw) + ".trainer", ignore_errors=True)
    write_json(target.with_name(STATS_FILE), stats)
    return stats


def main(argv: list[str]) -> int:
    import yaml

    if len(argv) != 2:
        print("usage: python -m stages.sft.masking <llamafactory-args.yaml> <tokenized_dir>", file=sys.stderr)
        return 2
    args = yaml.safe_load(Path(argv[0]).read_text())
    stats = pretokenize(args, argv[1], num_proc=int(args.get("preprocessing_num_workers") or 1))
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
