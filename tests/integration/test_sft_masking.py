"""Result masking on the labels LLaMA-Factory itself builds and then loads for training (`tokenized_path`)."""

from __future__ import annotations

import pytest
import torch

from stages.core.config.sft import SFTSection
from stages.sft.formats import write_lf_dataset
from stages.sft.lf_config import sft_train_args
from stages.sft.masking import IGNORE_INDEX, mask_results, pretokenize

pytestmark = pytest.mark.integration
torch.set_num_threads(1)

SYSTEM = "Use the tools."
MATH = ("<think> big product </think>\n<python>\nprint(12*7)\n</python> <result>\n84\n</result>\n"
        "<think> it printed 84 </think>\n<answer> The final answer is \\[ \\boxed{84} \\] </answer>")
SEARCH = ("<think> look it up </think>\n<search> Kelmor </search> <result>\nKelmor is a city.\n</result>\n"
          "<think> next </think>\n<search> Kelmor province </search> <result>\nKelmor lies in Vask.\n</result>\n"
          "<think> so Vask </think>\n<answer> The final answer is \\[ \\boxed{Vask} \\] </answer>")
ROWS = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}], "system": SYSTEM}
        for q, a in (("What is 12*7?", MATH), ("Which province is Kelmor in?", SEARCH))]


def _load_like_training(args: dict):
    """What LLaMA-Factory's SFT workflow does before training: parse args, tokenizer, template, get_dataset."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    model_args, data_args, training_args, _, _ = get_train_args(dict(args))
    module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    data = get_dataset(template, model_args, data_args, training_args, stage="sft", **module)["train_dataset"]
    return module["tokenizer"], data


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("mask")
    write_lf_dataset(ROWS, root / "dataset", "arpo_sft")
    cfg = SFTSection(cutoff_len=512, preprocessing_num_workers=1, dataloader_num_workers=0, bf16=False)
    args = sft_train_args(cfg, model_path=tiny_model.path, template="smollm2", dataset_dir=str(root / "dataset"),
                          dataset="arpo_sft", output_dir=str(root / "trainer"))
    stats = pretokenize(args, root / "tokenized")
    _, plain = _load_like_training(args | {"output_dir": str(root / "plain")})
    tokenizer, masked = _load_like_training(args | {"tokenized_path": str(root / "tokenized"),
                                                    "output_dir": str(root / "masked")})
    return tokenizer, plain, masked, stats


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_masked_tokens_are_exactly_the_result_spans(built) -> None:
    tokenizer, plain, masked, stats = built
    for row, plain_row, masked_row in zip(ROWS, plain, masked):
        assert masked_row["input_ids"] == plain_row["input_ids"]  # same tokens, only labels differ
        newly = [t for t, a, b in zip(masked_row["input_ids"], plain_row["labels"], masked_row["labels"])
                 if a != IGNORE_INDEX and b == IGNORE_INDEX]
        results = [part.split("\n</result>")[0] for part in row["conversations"][1]["value"].split(" <result>\n")[1:]]
        # the newly unlabeled tokens decode to the result insertions, space included, and nothing else
        assert _decode(tokenizer, newly) == "".join(f" <result>\n{r}\n</result>" for r in results)
        trained = [v for v in masked_row["labels"] if v != IGNORE_INDEX]
        text = _decode(tokenizer, trained)
        assert "<result>" not in text and "</result>" not in text
        assert text.endswith("</answer><|im_end|>\n") and ("<python>" in text or "<search>" in text)


def test_mask_counts_are_hand_derivable(built) -> None:
    tokenizer, _, _, stats = built
    # SmolLM2 splits " <result>\n84\n</result>" into 'Ġ<' 'result' '>' 'Ċ' '8' '4' 'Ċ' '</' 'result' '>' = 10 tokens
    pieces = tokenizer(" <result>\n84\n</result>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(pieces) == ["Ġ<", "result", ">", "Ċ", "8", "4", "Ċ", "</", "result", ">"]
    two_results = sum(len(tokenizer(f" <result>\n{r}\n</result>", add_special_tokens=False)["input_ids"])
                      for r in ("Kelmor is a city.", "Kelmor lies in Vask."))
    assert stats["rows"] == 2 and stats["masked_tokens"] == 10 + two_results
    assert stats["trained_tokens_after"] == stats["trained_tokens_before"] - stats["masked_tokens"]


def test_prompt_tokens_match_the_hf_chat_template_rl_uses(built) -> None:
    tokenizer, _, masked, _ = built
    for row, masked_row in zip(ROWS, masked):
        prompt = masked_row["labels"].index(next(v for v in masked_row["labels"] if v != IGNORE_INDEX))
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["conversations"][0]["value"]}],
            add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
        assert masked_row["input_ids"][:prompt] == expected


def test_a_result_cut_by_cutoff_len_is_masked_to_the_end(built) -> None:
    tokenizer = built[0]
    ids = tokenizer("<think> a </think>\n<python>\nx\n</python> <result>\nvery long output that was cut",
                    add_special_tokens=False)["input_ids"]
    labels, masked = mask_results(tokenizer, ids, list(ids))
    start = next(i for i, t in enumerate(tokenizer.convert_ids_to_tokens(ids)) if t == "Ġ<")
    assert labels[:start] == ids[:start] and labels[start:] == [IGNORE_INDEX] * (len(ids) - start)
    assert masked == len(ids) - start
