"""Weight sync into a sampler that holds its own copy of the weights (the in-process vLLM engine of the vLLM rollout
backend), done so that it cannot silently skip a tensor.

Two ways a refresh can leave the sampler on old weights, both seen on vLLM 0.32 (docs/rl.md, "The sampler is the
policy"):

- **An alias never sent.** `model.named_parameters()` yields a shared tensor once, under its first name: with tied
  embeddings (SmolLM2, Qwen2.5-0.5B to 3B, Qwen3-0.6B to 4B) that is `model.embed_tokens.weight`, and
  `lm_head.weight` never reaches the engine. vLLM's layer-wise reload loads the embedding, finds nothing for its
  `ParallelLMHead` (whose kernel copy the CPU backend packs separately), logs "Failed to load weights" and keeps the
  old head: the sampler draws from the new body with the old head. `trainer_tensors` sends every name of every
  tensor (`remove_duplicate=False`), so a tied head travels under both names, as in a checkpoint.
- **A layer the sampler could not load.** `reload_audited` runs vLLM's own in-place reload
  (`Worker.reload_weights`) and reads vLLM's per-layer load accounting just before vLLM finalises it: a layer with
  loadable elements of which fewer were loaded than it holds is an error naming the layer (module path, class,
  elements loaded / expected), instead of vLLM's warning and its silent fallback to the old tensors.

Layers that hold no checkpoint weights are listed here, by kind, and are never an error: rotary embeddings (a
cos/sin cache computed at start-up) and attention layers (they hold only quantisation scales, `k_scale`/`v_scale`
and the like, which an unquantised checkpoint does not carry). A vocabulary layer may load fewer elements than it
holds by exactly its padding rows (vLLM pads the vocabulary to a multiple of 64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stages.core.errors import DeterministicError
from stages.core.log import get_logger

log = get_logger(__name__)

# vLLM layer classes that own tensors but no checkpoint weights (matched on the class name and its bases)
WEIGHTLESS_LAYER_KINDS: tuple[str, ...] = ("RotaryEmbedding", "Attention")


class SamplerSyncError(DeterministicError):
    """A weight refresh left some of the sampler's layers on their old weights."""


@dataclass(frozen=True)
class LayerLoad:
    """One layer of the sampler's model after a refresh: elements loaded of the elements it can load."""

    name: str
    kind: str
    loaded: int
    expected: int


def trainer_tensors(model: Any) -> list[tuple[str, Any]]:
    """Every tensor of the trainer's model under every name it has (aliases included: a tied LM head is sent as
    `lm_head.weight` beside `model.embed_tokens.weight`), as checkpoint-format (name, tensor) pairs."""
    return [(name, param.data) for name, param in model.named_parameters(remove_duplicate=False)]


def weightless(layer: Any) -> bool:
    """A layer that owns tensors but never has checkpoint weights (WEIGHTLESS_LAYER_KINDS)."""
    kinds = {cls.__name__ for cls in type(layer).__mro__}
    return any(kind in kinds for kind in WEIGHTLESS_LAYER_KINDS)


def padding_elements(layer: Any) -> int:
    """Elements of a vocabulary layer that no checkpoint fills: its padding rows (0 for any other layer)."""
    padded, real = getattr(layer, "num_embeddings_padded", None), getattr(layer, "org_vocab_size", None)
    width = getattr(layer, "embedding_dim", None)
    if padded is None or real is None or width is None:
        return 0
    return max(0, int(padded) - int(real)) * int(width)


def short_layers(loads: list[LayerLoad], padding: dict[str, int]) -> list[LayerLoad]:
    """The layers that loaded fewer elements than they hold, beyond their padding (pure; `padding` by layer name)."""
    return [load for load in loads if load.expected > 0 and load.expected - load.loaded > padding.get(load.name, 0)]


def describe(short: list[LayerLoad]) -> str:
    shown = ", ".join(f"{s.name} ({s.kind}: {s.loaded} of {s.expected} elements loaded)" for s in short[:8])
    more = f" and {len(short) - 8} more" if len(short) > 8 else ""
    return (f"the weight refresh left {len(short)} layer(s) of the sampler on their old weights: {shown}{more}. The "
            "sampler would draw from a mix of new and old weights, which no log-prob correction undoes. Every trainer "
            "tensor is sent under every name it has (stages/generation/weight_sync.py); a layer still missing means "
            "the sampler names it differently: map the name, or, if the layer truly has no checkpoint weights, add "
            "its kind to WEIGHTLESS_LAYER_KINDS there")


@contextlib.contextmanager
def audit_layerwise_reload(model: Any) -> Iterator[list[LayerLoad]]:
    """While active, vLLM's layer-wise reload records, just before it finalises, every layer of `model` that had
    elements to load (vLLM's own counters: `LayerReloadingInfo.load_numel` / `load_numel_total`); weightless layers
    are left out. Yields the list it fills. A vLLM without this module (not 0.32, the pinned one) yields an empty
    list with a warning: the drift alarm (`sampler_drift`, stages/rl/alarms.py) is then the only check."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        log.warning("this vLLM has no layer-wise reload module: weight refreshes are not audited per layer (the "
                    "sampler_drift alarm still compares sampler and trainer log-probs every step)")
        yield []
        return
    loads: list[LayerLoad] = []
    original = layerwise.finalize_layerwise_processing

    def finalize_with_audit(target: Any, *args: Any, **kwargs: Any) -> Any:
        for name, layer in target.named_modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load() or weightless(layer):
                continue
            loads.append(LayerLoad(name, type(layer).__name__, int(info.load_numel), int(info.load_numel_total)))
        return original(target, *args, **kwargs)

    layerwise.finalize_layerwise_processing = finalize_with_audit
    try:
        yield loads
    finally:
        layerwise.finalize_layerwise_processing = original


def _reload_in_worker(worker: Any, weights: list[tuple[str, Any]]) -> tuple[list[LayerLoad], dict[str, int]]:
    """Runs inside the vLLM worker that holds the model (collective_rpc): its in-place reload, audited."""
    model = worker.model_runner.get_model()
    padding = {name: padding_elements(layer) for name, layer in model.named_modules()}
    with audit_layerwise_reload(model) as loads:
        # vLLM's in-place reload: checkpoint-format names, then the layers' post-load processing again (the CPU
        # backend repacks linear weights after loading, so a plain model.load_weights no longer finds its loaders)
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    return loads, padding


def reload_audited(llm: Any, weights: list[tuple[str, Any]]) -> list[LayerLoad]:
    """vLLM's in-place reload of `weights` into the in-process engine `llm`; raises SamplerSyncError naming every
    layer left short of its weights. Returns the per-layer loads."""
    ((loads, padding),) = llm.collective_rpc(_reload_in_worker, args=(weights,))
    short = short_layers(loads, padding)
    if short:
        raise SamplerSyncError(describe(short))
    return loads


__all__ = ["LayerLoad", "SamplerSyncError", "WEIGHTLESS_LAYER_KINDS", "describe", "padding_elements",
           "reload_audited", "short_layers", "trainer_tensors", "weightless"]
