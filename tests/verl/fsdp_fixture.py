"""Writes a checkpoint the way verl 0.9.1 does on a 2-rank FSDP2 run, with verl's own FSDPCheckpointManager on CPU
(gloo), plus what the trainer adds (data.pt, latest_checkpointed_iteration.txt). `tests/fixtures/verl_fsdp_0.9.1`
was made by this script (python -m tests.verl.fsdp_fixture <dir>); tests/verl/test_checkpoint.py regenerates it
and checks that the committed copy still has verl's layout.

Layout: <dir>/global_step_1/actor/{model,optim,extra_state}_world_size_2_rank_{0,1}.pt, fsdp_config.json,
huggingface/ (config, generation config, tokenizer); <dir>/global_step_1/data.pt;
<dir>/latest_checkpointed_iteration.txt; plus <dir>/original/ (the weights before sharding, for parity).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

WORLD = 2
WORDS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "<think>",
         "</think>", "<search>", "</search>", "<python>", "</python>", "<result>", "</result>", "<answer>",
         "</answer>", "\\boxed{42}", "What", "is", "6*7?", "the", "answer", "a", "query", "check", "print(1)", "1",
         "42", "7", "yes", "no", "and", "of", "to", "in", "for", "on"]


def tiny_tokenizer():
    """A word-level fast tokenizer with a ChatML template (no download), vocabulary < 64."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return tok


def tiny_model(tie_word_embeddings: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=33, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie_word_embeddings, eos_token_id=5, bos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


def _rank(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/.pg_init", rank=rank, world_size=WORLD)
    model, tokenizer = tiny_model(), tiny_tokenizer()
    if rank == 0:
        model.save_pretrained(f"{out}/original", safe_serialization=True)
        tokenizer.save_pretrained(f"{out}/original")
    model.config.name_or_path = f"{out}/original"  # verl copies the generation config from here
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = FSDPCheckpointManager(model, optimizer, None, processing_class=tokenizer, checkpoint_config=None)
    manager.save_checkpoint(f"{out}/global_step_1/actor", None, 1)
    dist.barrier()
    if rank == 0:  # what the v1 trainer writes beside the actor folder
        from torchdata.stateful_dataloader import StatefulDataLoader

        torch.save(StatefulDataLoader(list(range(8)), batch_size=2).state_dict(), f"{out}/global_step_1/data.pt")
        Path(f"{out}/latest_checkpointed_iteration.txt").write_text("1")
    dist.destroy_process_group()


def write_fixture(out: str | Path) -> Path:
    import torch.multiprocessing as mp

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(str(out),), nprocs=WORLD)
    (out / ".pg_init").unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    print(write_fixture(sys.argv[1]))
