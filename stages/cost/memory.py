"""Peak device memory per GPU of each phase of a verl RL step, before anything starts (docs/plan.md "Memory").

    est = memory_estimate(cfg)     # None: not the verl engine, or the model is not in stages/core/archs.py
    est.phases                     # rollout, old_log_prob, [ref_log_prob], actor_update: GiB per GPU, by part
    check_memory(cfg, stages)      # pre-flight: BadInputError naming the phase and the setting that fixes it

Each phase is the sum of what is resident on the GPU (FSDP shards, optimizer state, the reference model) and what
the phase materialises at its worst micro-batch: verl's dynamic-batching partition of one GPU's sequences is
re-computed (stages/cost/partition.py) over `cost.response_length_mix`, padded to each micro-batch's longest
sequence when remove-padding is off (`rl.verl.remove_padding`, resolved as the mapping resolves it). The counts of
full-vocabulary copies are read from the pinned verl's code (the docs list file:line); the log-prob pass's logits working
set is checked on CPU by bench/bench_memory_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stages.core.archs import Arch, arch_for
from stages.core.config.loader import RunConfig
from stages.core.config.rl_engine import PACKED_SDPA_FAMILIES
from stages.core.engine_spec import ENGINES
from stages.core.errors import BadInputError
from stages.cost.partition import MicroBatch, fixed_micro_batches, micro_batches

GIB = 2 ** 30
RESERVE_GIB = 2.0          # CUDA contexts of the trainer and the vLLM server, NCCL buffers, allocator slack (assumed)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MASTER, GRAD, ADAM = 4, 4, 8   # bytes per parameter: fp32 master weights (fsdp model_dtype fp32), fp32 gradients,
                               # two fp32 AdamW moments
ENTROPY_COPIES = 3   # old log-prob, no grad: logits, softmax(logits), the softmax*logits (or logsumexp) temporary
CHUNK_TOKENS = 2048  # verl's entropy_from_logits_with_chunking chunk (torch_functional.py:248)


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict[str, float]       # GiB per part
    fix: str                      # the settings that lower this phase, best first
    micro_batch: str = ""         # the worst micro-batch: rows x longest (padded / real tokens)

    @property
    def gib(self) -> float:
        return sum(self.parts.values())


@dataclass
class MemoryEstimate:
    model: str
    params: int
    gpus: int
    device_gib: float
    phases: list[Phase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def over(self) -> list[Phase]:
        return [p for p in self.phases if p.gib > self.device_gib]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "params": self.params, "gpus": self.gpus, "device_gib": self.device_gib,
                "phases": [{"name": p.name, "gib": round(p.gib, 2), "parts": {k: round(v, 2) for k, v in
                            p.parts.items()}, "micro_batch": p.micro_batch, "fix": p.fix} for p in self.phases],
                "notes": self.notes}


def split_counts(mix: list[tuple[float, float]], total: int) -> list[int]:
    """Largest-remainder counts of `total` items over the mix's shares (ties: the earlier pair)."""
    raw = [share * total for share, _ in mix]
    counts = [int(r) for r in raw]
    order = sorted(range(len(mix)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def sequence_lengths(mix: list[tuple[float, float]], count: int, prompt: int, response: int) -> list[int]:
    """`count` sequences of the mix: prompt + fraction x response tokens each, longest first."""
    lengths = [prompt + max(1, round(frac * response)) for (_, frac), n in zip(mix, split_counts(mix, count))
               for _ in range(n)]
    return sorted(lengths, reverse=True)


def logits_bytes(mb: MicroBatch, vocab: int, dtype_bytes: int, remove_padding: bool, pass_: str,
                 temperature: float = 1.0, chunked_entropy: bool = False) -> int:
    """The full-vocabulary tensors alive at once in one micro-batch (verl's FSDP engine, docs/plan.md):

    no remove-padding: the model's logits are [rows, longest, V] (transformer_impl.py:1477); entropy (old log-prob
    only) is unchunked there (:1489-1493): softmax + one temporary beside the logits; then the real tokens are packed
    into a copy (:1500-1503) for the log-probs (:1522; torch_functional.py:173-207 loops per row: no further full
    copy).
    remove-padding: logits are [real tokens, V]; with chunked entropy (entropy_from_logits_with_chunking, :1399)
    the softmax runs on float32 chunks of 2048 tokens (3 chunk-sized tensors).
    A temperature other than 1 divides into a new tensor while the model output stays referenced (:98-103).
    Training (`update`) keeps the packed copy's log-softmax for backward and then holds the gradients of the
    logits and of the packed copy (2 x padded + 3 x real copies); entropy in the loss (rl.loss.entropy_coef > 0)
    adds its 2 saved copies (the caller adds them).
    """
    rows = mb.real if remove_padding else mb.padded     # the model's logits
    scaled = rows if temperature not in (0.0, 1.0) else 0
    packed = 0 if remove_padding else mb.real           # the real tokens' packed copy
    if pass_ == "old_log_prob":
        if remove_padding and chunked_entropy:
            entropy = 3 * min(CHUNK_TOKENS, mb.real) * 2   # float32 chunks: 2x the bytes of a bf16 copy
        else:
            entropy = (ENTROPY_COPIES - 1) * rows
        copies = rows + scaled + max(entropy, packed)
    elif pass_ == "ref_log_prob":
        copies = rows + scaled + packed
    else:   # update: forward (logits, packed copy, saved log-softmax), backward (their gradients)
        copies = 2 * rows + scaled + packed + 2 * mb.real
    return copies * vocab * dtype_bytes


def activation_bytes(arch: Arch, mb: MicroBatch, dtype_bytes: int, remove_padding: bool, grad: bool,
                     checkpointing: bool, attn: str) -> int:
    """Hidden-state activations of one micro-batch (no logits). Without gradient: the residual stream and the
    SwiGLU intermediates of one layer, tokens x (2h + 3i). With gradient: what one layer saves for backward,
    tokens x (7h + 4 kv + 4i) (norm inputs, q/k/v/o, attention output, gate, up, act, product), for every layer
    without checkpointing; with checkpointing each layer's input (tokens x h) plus one recomputed layer. Eager
    attention adds rows x heads x longest^2 scores and probabilities (one row of the packed tokens with
    remove-padding; sdpa / flash kernels keep them O(L), sdpa's mask is mask_bytes)."""
    tokens = mb.real if remove_padding else mb.padded
    h, i, kv = arch.hidden, arch.intermediate, arch.kv_width
    if not grad:
        elems = tokens * (2 * h + 3 * i)
    else:
        layer = tokens * (7 * h + 4 * kv + 4 * i)
        elems = arch.layers * tokens * h + layer if checkpointing else arch.layers * layer
    if attn == "eager":
        elems += 2 * arch.heads * (mb.real ** 2 if remove_padding else mb.rows * mb.longest ** 2)
    return elems * dtype_bytes


def mask_bytes(mb: MicroBatch, dtype_bytes: int, remove_padding: bool, attn: str) -> int:
    """The attention mask transformers 5.9 materialises for sdpa (masking_utils.py `sdpa_mask`): a boolean
    [rows, 1, L, L] when the micro-batch is padded (none when every row has the same length: is_causal, :521), and
    with remove-padding one [1, 1, T, T] over the T packed tokens, block-diagonal from the packed position ids
    (:880-888, :992-994; none for a single sequence). torch's sdpa converts a boolean mask into one of the compute
    dtype before its kernel (assumed, not measured here): 1 + dtype bytes per element. flash_attention_2 builds no
    mask; eager's scores are counted in activation_bytes."""
    if attn != "sdpa":
        return 0
    if remove_padding:
        elems = mb.real ** 2 if mb.rows > 1 else 0
    else:
        elems = mb.rows * mb.longest ** 2 if len(set(mb.lengths)) > 1 else 0
    return elems * (1 + dtype_bytes)


def memory_estimate(cfg: RunConfig) -> MemoryEstimate | None:
    """The verl engine's per-GPU peak of each phase; None for the local engine, a model not in the table, or a
    rehearsal's toy model (its name is the real model's; `arpo rehearse` reports the real profile's estimate)."""
    if not cfg.rl.enabled or not ENGINES.get(cfg.rl.engine).priced or cfg.model.source == "toy":
        return None
    found = arch_for(cfg.model.name, cfg.model.path)
    if found is None:
        return None
    key, arch = found
    vs, ro, tr = cfg.rl.verl, cfg.rl.rollout, cfg.rl.trainer
    n = vs.nnodes * vs.n_gpus_per_node
    c = DTYPE_BYTES.get(cfg.model.dtype, 2)
    P = arch.params
    rmpad = vs.uses_remove_padding(arch.model_type)   # as stages/rl/verl/mapping.py resolves it
    mix = cfg.cost.response_length_mix
    per_gpu = sequence_lengths(mix, -(-tr.train_batch_size * ro.n // n), ro.max_prompt_length,
                               ro.max_response_length)
    mini = sequence_lengths(mix, -(-tr.ppo_mini_batch_size * ro.n // n), ro.max_prompt_length,
                            ro.max_response_length)
    budget = vs.max_token_len_per_gpu

    def parts_of(bpp: float) -> float:
        return bpp * P / n / GIB

    master = parts_of(MASTER)
    optim = 0.0 if vs.optimizer_offload else parts_of(ADAM)
    ref = parts_of(MASTER) if cfg.rl.loss.kl_coef > 0 else 0.0
    gathered = (arch.root_params + 2 * arch.layer_params) * c / GIB   # the root group + current and next layer

    def resident(offload_params: bool = False) -> dict[str, float]:
        out = {"actor params (fp32 shard)": 0.0 if offload_params else master, "optimizer state": optim,
               "reference params": ref, "runtime reserve": RESERVE_GIB}
        return {k: v for k, v in out.items() if v}

    out = MemoryEstimate(key, P, n, cfg.cost.gpu_memory_gib)
    out.phases.append(Phase("rollout", {"vLLM (weights + KV cache)": vs.gpu_memory_utilization * out.device_gib,
                                        **resident(vs.param_offload)},
                            _fix_rollout(cfg)))
    log_prob_mbs = (micro_batches(per_gpu, 2 * budget) if budget
                    else fixed_micro_batches(per_gpu, tr.micro_batch_size))
    out.phases.append(_pass_phase("old_log_prob", log_prob_mbs, arch, c, rmpad, cfg, resident(), gathered))
    if cfg.rl.loss.kl_coef > 0:
        ref_mbs = micro_batches(per_gpu, budget) if budget else fixed_micro_batches(per_gpu, tr.micro_batch_size)
        out.phases.append(_pass_phase("ref_log_prob", ref_mbs, arch, c, rmpad, cfg, resident(), gathered))
    update_mbs = micro_batches(mini, budget) if budget else fixed_micro_batches(mini, tr.micro_batch_size)
    out.phases.append(_pass_phase("actor_update", update_mbs, arch, c, rmpad, cfg,
                                  {**resident(), "gradients (fp32 shard)": parts_of(GRAD)}, gathered))
    if vs.optimizer_offload:   # loaded back for the step, after the activations are freed
        step = {**resident(), "gradients (fp32 shard)": parts_of(GRAD), "optimizer state (loaded for the step)":
                parts_of(ADAM)}
        out.phases.append(Phase("optimizer_step", step, "set rl.verl.n_gpus_per_node / nnodes higher (more shards)"))
    out.notes = _notes(cfg, arch, per_gpu, mini, rmpad)
    return out


def _pass_phase(name: str, mbs: list[MicroBatch], arch: Arch, c: int, rmpad: bool, cfg: RunConfig,
                resident: dict[str, float], gathered: float) -> Phase:
    """A forward (old / reference log-probs) or forward + backward (actor update) pass at its worst micro-batch."""
    grad = name == "actor_update"
    temp = cfg.rl.rollout.temperature
    chunked = "entropy_from_logits_with_chunking=true" in " ".join(cfg.rl.verl.extra_overrides)

    def transient(mb: MicroBatch) -> tuple[float, float]:
        logits = logits_bytes(mb, arch.vocab, c, rmpad, "update" if grad else name, temp, chunked)
        if grad and cfg.rl.loss.entropy_coef > 0:
            logits += 2 * (mb.real if rmpad else mb.padded) * arch.vocab * c
        acts = activation_bytes(arch, mb, c, rmpad, grad, cfg.rl.trainer.gradient_checkpointing,
                                cfg.rl.verl.attn_implementation)
        mask = mask_bytes(mb, c, rmpad, cfg.rl.verl.attn_implementation)
        return logits / GIB, acts / GIB, mask / GIB

    worst = max(mbs, key=lambda mb: sum(transient(mb)))
    logits, acts, mask = transient(worst)
    parts = {**resident, "unsharded params (bf16 gather)": gathered, "activations": acts,
             "logits (full vocabulary)": logits, **({"attention mask (sdpa)": mask} if mask else {})}
    tokens = worst.real if rmpad else worst.padded
    shape = (f"{worst.rows} sequences, {tokens:,} packed tokens" if rmpad else
             f"{worst.rows} x {worst.longest} = {tokens:,} tokens materialised ({worst.real:,} real)")
    shape += f", the worst of {len(mbs)} micro-batches"
    return Phase(name, parts, _fix_pass(name, cfg, rmpad), shape)


def _fix_rollout(cfg: RunConfig) -> str:
    vs = cfg.rl.verl
    fixes = [f"lower rl.verl.gpu_memory_utilization (now {vs.gpu_memory_utilization:g})"]
    fixes += [f"set rl.verl.{k}: true" for k in ("optimizer_offload", "param_offload") if not getattr(vs, k)]
    return "; ".join(fixes)


def _fix_pass(name: str, cfg: RunConfig, rmpad: bool) -> str:
    vs = cfg.rl.verl
    budget = vs.max_token_len_per_gpu
    if budget:
        which = "the log-prob budget is 2x it" if name == "old_log_prob" else "the token budget of this pass"
        fixes = [f"lower rl.verl.max_token_len_per_gpu (now {budget}; {which})"]
    else:
        fixes = [f"lower rl.trainer.micro_batch_size (now {cfg.rl.trainer.micro_batch_size})"]
    if not rmpad:
        fixes.append("turn on remove-padding (rl.verl.remove_padding: true; auto does with sdpa for "
                     f"{'/'.join(PACKED_SDPA_FAMILIES)} models and with flash_attention_2) so micro-batches hold "
                     "only real tokens")
    if not vs.optimizer_offload:
        fixes.append("set rl.verl.optimizer_offload: true")
    if name == "actor_update" and not cfg.rl.trainer.gradient_checkpointing:
        fixes.append("set rl.trainer.gradient_checkpointing: true")
    return "; ".join(fixes)


def _notes(cfg: RunConfig, arch: Arch, per_gpu: list[int], mini: list[int], rmpad: bool) -> list[str]:
    vs = cfg.rl.verl
    return [f"{arch.params / 1e9:.2f}B parameters ({arch.layers} layers, hidden {arch.hidden}, vocabulary "
            f"{arch.vocab}); FSDP over {vs.nnodes * vs.n_gpus_per_node} GPU(s), {cfg.model.dtype} compute, fp32 "
            "master weights, gradients and AdamW state",
            f"per GPU: {len(per_gpu)} sequences per step, {len(mini)} per mini-batch, lengths from "
            f"cost.response_length_mix {cfg.cost.response_length_mix} of rl.rollout.max_response_length, prompts "
            f"at max_prompt_length; remove-padding {'on' if rmpad else 'off'} (rl.verl.remove_padding: "
            f"{str(vs.remove_padding).lower()}, {vs.attn_implementation}, {arch.model_type or 'unknown'} family)"
            + ("" if rmpad else ": each micro-batch is padded to its longest sequence"),
            f"runtime reserve {RESERVE_GIB:g} GiB (CUDA contexts, NCCL, allocator slack) is an assumption, not "
            "measured"]


def memory_problem(est: MemoryEstimate) -> str | None:
    """One message naming every phase over the device and its fix, or None when all fit."""
    over = est.over
    if not over:
        return None
    lines = [f"{p.name} needs ~{p.gib:.1f} GiB per GPU (largest: {max(p.parts, key=p.parts.get)} "
             f"{max(p.parts.values()):.1f} GiB{'; ' + p.micro_batch if p.micro_batch else ''}): {p.fix}"
             for p in over]
    return (f"the memory model (docs/plan.md \"Memory\") puts {est.model} over one {est.device_gib:g} GiB GPU "
            f"(cost.gpu_memory_gib) in {len(over)} phase(s): " + " | ".join(lines)
            + ". `arpo plan` shows every phase")


def check_memory(cfg: RunConfig, stages: Any) -> MemoryEstimate | None:
    """The RL stage's pre-flight check (stages/core/stage_spec.py names it; stages.core.preflight runs it when RL
    runs): refuse a verl RL run whose estimated peak exceeds the device."""
    est = memory_estimate(cfg)
    problem = memory_problem(est) if est else None
    if problem:
        raise BadInputError(problem)
    return est
