"""GPU first-run check (docs/gpu-check.md): the local RL engine's ARPO step on one device, its peak memory against
the memory model, and the chunked entropy against the unchunked formula.

    python scripts/gpu_check.py                       # CUDA, bfloat16, Qwen-shaped 4 layers, 4 x 4096-token responses
    python scripts/gpu_check.py --device cpu --layers 1 --hidden 32 --intermediate 64 --heads 4 --kv-heads 2 \
        --rows 2 --micro-batch 1 --prompt 16 --response 64 --check-tokens 32

A random-init transformers Qwen2 (untied, sdpa, the real 151,936-token vocabulary; sizes are flags) in float32
master weights runs `--steps` steps of the local engine's own functions: `build_step_tensors` (old log-probs and
full-vocabulary entropies of every response through the chunked `token_logprobs`, GRPO advantages) and
`ppo_update` (ARPO's dual-clip PPO loss, backward, gradient clipping, one AdamW step) under bf16 autocast, as
stages/rl/trainer.py calls them. The last step is measured: torch.cuda.max_memory_allocated on CUDA, the
process's RSS high-water mark (VmHWM, reset before the step) on CPU; the prediction sums the memory model's terms
(stages/cost/memory.py: bytes per parameter, activations) and the chunked path's full-vocabulary copies.
Then one response's logits go through the chunked and the unchunked formula on the device: values and gradients
must agree within the tolerances. Prints a table, writes a JSON file, exits 1 when a check fails.

Needs torch, transformers and, for the repository's modules, pydantic and rich (docs/gpu-check.md: wheels).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.core.archs import Arch
    from stages.core.config.rl import RLSection
    from stages.cost.memory import ADAM, GRAD, MASTER, activation_bytes
    from stages.cost.partition import MicroBatch
    from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory
    from stages.rl import logprobs as lp
    from stages.rl.modeling import configure_for_training
    from stages.rl.update import build_step_tensors, ppo_update
except ModuleNotFoundError as exc:  # pragma: no cover - the message is the point
    sys.exit(f"error: python module '{exc.name}' is missing; install it from the wheels folder that travels with "
             "this script: pip install --no-index --find-links gpu-check-wheels pydantic rich (docs/gpu-check.md)")

GIB = 2 ** 30
TOLERANCE = {"logp": 1e-3, "entropy": 1e-4, "grad": 1e-5}  # float32 sums over 151,936 logits in another order
RATIO_BAND = (0.85, 1.15)  # measured / predicted on CUDA counted as agreement


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype (autocast)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5 / Qwen3 logits: 151,936)")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per row")
    ap.add_argument("--response", type=int, default=4096, help="response tokens per row (all rows this long)")
    ap.add_argument("--rows", type=int, default=4, help="trajectories: one GRPO group (rollout.n)")
    ap.add_argument("--micro-batch", type=int, default=2, help="rl.trainer.micro_batch_size")
    ap.add_argument("--steps", type=int, default=2, help="RL steps; the last is measured (>= 2: AdamW state exists)")
    ap.add_argument("--check-tokens", type=int, default=1024, help="response positions of the entropy check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--out", default="gpu_check.json", help="JSON result file")
    return ap.parse_args(argv)


def rl_config(a: argparse.Namespace) -> RLSection:
    """The local engine's config for one group of `rows` ARPO trajectories, every row in one mini-batch."""
    return RLSection.model_validate({
        "algorithm": "arpo",
        "rollout": {"n": a.rows, "initial_rollouts": max(1, a.rows // 2), "max_prompt_length": a.prompt,
                    "max_response_length": a.response},
        "trainer": {"train_batch_size": 1, "ppo_mini_batch_size": 1, "micro_batch_size": a.micro_batch,
                    "old_logprobs": "recompute", "shared_prompt": False},
    })


def build_model(a: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      tie_word_embeddings=False, max_position_embeddings=a.prompt + a.response + 8,
                      attn_implementation="sdpa")
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(cfg).to(device)  # float32 master weights, as the local trainer loads them
    return configure_for_training(model, False)


def rollouts(a: argparse.Namespace) -> tuple[RolloutBatch, list[float]]:
    """One prompt's tree: `rows` full-length responses, the second half branched from the first root at 1/4 of the
    response (shared prefix), a tool result (loss mask 0) over [T/2, T/2 + T/8); rewards alternate 1, 0."""
    gen = torch.Generator().manual_seed(a.seed)
    prompt = torch.randint(0, a.vocab, (a.prompt,), generator=gen).tolist()
    T, fork = a.response, a.response // 4
    mask = [0 if T // 2 <= t < T // 2 + T // 8 else 1 for t in range(T)]
    trajs: list[Trajectory] = []
    for i in range(a.rows):
        ids = torch.randint(0, a.vocab, (T,), generator=gen).tolist()
        branch = i >= max(1, a.rows // 2)
        if branch:
            ids[:fork] = trajs[0].response_ids[:fork]
        trajs.append(Trajectory(i, 0, prompt, ids, list(mask), parent_id=0 if branch else None,
                                fork_at=fork if branch else 0, kind="branch" if branch else "root"))
    group = RolloutGroup(0, "q", "a", "check", trajs, initial_rollouts=max(1, a.rows // 2))
    return RolloutBatch([group]), [float(i % 2 == 0) for i in range(a.rows)]


class Meter:
    """Peak memory of one phase: the CUDA allocator's, or the process RSS high-water mark on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "VmHWM (process peak RSS)"

    def current(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return _status("VmRSS")

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            pass

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status("VmHWM")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}: the CPU measurement needs Linux")


def run_steps(a: argparse.Namespace, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
              meter: Meter) -> tuple[list[dict[str, float]], int, int]:
    """`--steps` RL steps as the trainer makes them; returns per-step figures and, for the last step, the memory
    before it and its peak."""
    cfg = rl_config(a)
    batch, rewards = rollouts(a)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas,   # as trainer.make_optimizer
                                  weight_decay=cfg.optim.weight_decay, fused=True)
    steps, before, peak = [], 0, 0
    for step in range(a.steps):
        last = step == a.steps - 1
        if last:
            before = meter.current()
            meter.reset()
        start = time.perf_counter()
        tensors = build_step_tensors(cfg, model, None, batch, rewards, 0, device, dtype)
        update = ppo_update(cfg, model, optimizer, tensors, a.rows, device, dtype)
        if last:
            peak = meter.peak()
        seconds = time.perf_counter() - start
        entropy = float((tensors.entropy_BT * tensors.batch.mask_BT).sum() / tensors.batch.mask_BT.sum())
        steps.append({"seconds": round(seconds, 3), "loss": update["loss"], "grad_norm": update["grad_norm"],
                      "optimizer_steps": update["optimizer_steps"], "entropy": entropy})
    return steps, before, peak


def arch_of(a: argparse.Namespace) -> Arch:
    return Arch(hidden=a.hidden, layers=a.layers, intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads,
                vocab=a.vocab, qkv_bias=True)


def predict(a: argparse.Namespace, params: int, compute: torch.dtype) -> dict[str, dict[str, int]]:
    """Bytes of each phase of a step after the first (AdamW state exists), by part.

    Resident: fp32 weights, gradients (the previous step's, until `ppo_update` sets them to None) and AdamW's two
    moments (stages/cost/memory.py MASTER, GRAD, ADAM bytes per parameter). Under bf16 autocast every linear layer's
    weight gets a bf16 copy, held from the forward to its backward. Activations: memory.activation_bytes for one
    micro-batch (rows x (prompt + response), no remove-padding, sdpa). Full vocabulary (stages/rl/logprobs.py): the
    model's [rows, T + 1, V] logits in the compute dtype (`logits_to_keep`); the no-grad pass adds the chunked
    entropy's float32 chunk temporaries (the chunk's float copy when the logits are bf16, softmax, softmax * x);
    the update's backward holds the logits, their gradient and 3 float32 chunks (log p, p, g).
    """
    arch, c = arch_of(a), (2 if compute == torch.bfloat16 else 4)
    rows, T, V = a.micro_batch, a.response, a.vocab
    mb = MicroBatch(tuple([a.prompt + T] * rows))
    linear = arch.layers * (arch.layer_params - 2 * arch.hidden) + V * arch.hidden
    casts = 2 * linear if c == 2 else 0
    chunk = min(max(1, lp.CHUNK // rows) * rows, rows * T) * V * 4
    logits = rows * (T + 1) * V * c
    weights, grads, adam = MASTER * params, GRAD * params, ADAM * params
    no_grad = {"weights (fp32)": weights, "gradients (fp32, previous step)": grads, "AdamW moments": adam,
               "bf16 weight copies (autocast)": casts,
               "activations": activation_bytes(arch, mb, c, False, grad=False, checkpointing=False, attn="sdpa"),
               "logits": logits, "entropy chunks (fp32)": (3 if c == 2 else 2) * chunk}
    update = {"weights (fp32)": weights, "AdamW moments": adam, "bf16 weight copies (autocast)": casts,
              "activations": activation_bytes(arch, mb, c, False, grad=True, checkpointing=False, attn="sdpa"),
              "logits + their gradient": logits + rows * T * V * c, "backward chunks (fp32)": 3 * chunk}
    step = {"weights (fp32)": weights, "gradients (fp32)": grads, "AdamW moments": adam}
    return {"old_log_prob": no_grad, "update_backward": update, "optimizer_step": step}


def entropy_check(a: argparse.Namespace, model: torch.nn.Module, device: torch.device, dtype: torch.dtype
                  ) -> dict[str, object]:
    """One response's logits (the model's, on the device, in the compute dtype) through the chunked and the
    unchunked formula: log-probs, entropies and the gradients of a random combination of both."""
    gen = torch.Generator().manual_seed(a.seed + 1)
    n = a.check_tokens
    ids = torch.randint(0, a.vocab, (1, a.prompt + n), generator=gen).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids, logits_to_keep=n + 1, use_cache=False).logits[:, :n].detach()
    targets = ids[:, a.prompt:a.prompt + n]
    w_logp, w_ent = torch.randn(1, n, generator=gen).to(device), torch.randn(1, n, generator=gen).to(device)

    def run(fn):
        x = logits.clone().requires_grad_(True)
        logp, ent = fn(x, targets, True)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        return logp.detach().float(), ent.detach().float(), x.grad.float()

    ref, got = run(lp._token_logprobs), run(lp.token_logprobs)
    diffs = {name: float((g - r).abs().max()) for name, r, g in zip(("logp", "entropy"), ref, got)}
    # gradients are stored in the logits' dtype: compare within its rounding (bf16: 2^-8 relative)
    rel = 2.0 ** -8 if logits.dtype == torch.bfloat16 else 1e-5
    excess = float(((got[2] - ref[2]).abs() - rel * ref[2].abs()).max())
    diffs["grad"] = max(0.0, excess)
    ok = all(diffs[k] <= TOLERANCE[k] for k in TOLERANCE)
    return {"tokens": n, "chunk_positions": lp._positions(logits), "logits_dtype": str(logits.dtype).split(".")[-1],
            "max_abs_diff": diffs, "grad_relative_rounding": rel, "tolerance": TOLERANCE, "ok": ok}


def environment(device: torch.device) -> dict[str, object]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": device.type, "device_name": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"device_name": props.name, "device_memory_gib": round(props.total_memory / GIB, 1),
                "cuda": torch.version.cuda, "driver": _driver()}
    return env


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def pick(a: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; check "
                 "`nvidia-smi` and the driver (CUDA 13 wheels need driver >= 580), or run with --device cpu and "
                 "small sizes")
    if a.steps < 2:
        sys.exit("error: --steps must be at least 2 (the measured step needs the AdamW state of an earlier one)")
    if a.rows < 2 or a.micro_batch < 1 or a.micro_batch > a.rows:
        sys.exit("error: need --rows >= 2 (one GRPO group) and 1 <= --micro-batch <= --rows")
    return device, getattr(torch, a.dtype)


def measure(a: argparse.Namespace) -> dict[str, object]:
    device, dtype = pick(a)
    started = time.perf_counter()
    model = build_model(a, device)
    params = sum(p.numel() for p in model.parameters())
    meter = Meter(device)
    steps, before, peak = run_steps(a, model, device, dtype, meter)
    phases = predict(a, params, dtype)
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    resident = MASTER * params + GRAD * params + ADAM * params
    memory = {"measure": meter.kind, "before_bytes": before, "peak_bytes": peak, "transient_bytes": peak - before,
              "predicted_phases": phases, "predicted_peak_phase": worst, "predicted_peak_bytes": totals[worst],
              "predicted_before_bytes": resident, "predicted_transient_bytes": totals[worst] - resident}
    base = "peak_bytes" if device.type == "cuda" else "transient_bytes"   # RSS also counts Python and libraries
    memory["ratio"] = memory[base] / max(1, memory["predicted_" + base])
    memory["ratio_of"] = base
    memory["within_band"] = RATIO_BAND[0] <= memory["ratio"] <= RATIO_BAND[1] if device.type == "cuda" else None
    check = entropy_check(a, model, device, dtype)
    finite = all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
    return {"ok": bool(check["ok"] and finite), "environment": environment(device),
            "shape": {"vocab": a.vocab, "hidden": a.hidden, "intermediate": a.intermediate, "layers": a.layers,
                      "heads": a.heads, "kv_heads": a.kv_heads, "params": params, "prompt": a.prompt,
                      "response": a.response, "rows": a.rows, "micro_batch": a.micro_batch, "dtype": a.dtype},
            "steps": steps, "memory": memory, "entropy_check": check,
            "seconds": round(time.perf_counter() - started, 1)}


def table(result: dict) -> str:
    m, e, s, env = result["memory"], result["entropy_check"], result["shape"], result["environment"]
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    last = result["steps"][-1]
    rows = [("device", f"{env['device_name']} ({env['device']}), torch {env['torch']}, transformers "
                       f"{env['transformers']}"),
            ("model", f"Qwen2 {s['layers']} layers, hidden {s['hidden']}, vocab {s['vocab']:,}: "
                      f"{s['params'] / 1e6:.0f}M params"),
            ("step", f"{s['rows']} x ({s['prompt']} + {s['response']}) tokens, micro-batch {s['micro_batch']}, "
                     f"{s['dtype']}: {last['seconds']:.2f} s, loss {last['loss']:.4g}, grad norm "
                     f"{last['grad_norm']:.3g}"),
            ("memory before step", f"{gib(m['before_bytes'])} (predicted {gib(m['predicted_before_bytes'])})"),
            ("peak", f"{gib(m['peak_bytes'])} (predicted {gib(m['predicted_peak_bytes'])}, "
                     f"{m['predicted_peak_phase']})"),
            ("peak above before", f"{gib(m['transient_bytes'])} (predicted {gib(m['predicted_transient_bytes'])})"),
            ("measured / predicted", f"{m['ratio']:.2f} ({m['ratio_of']}; {m['measure']})"
                                     + ("" if m["within_band"] is None else
                                        f", band {RATIO_BAND[0]}-{RATIO_BAND[1]}: "
                                        f"{'yes' if m['within_band'] else 'NO'}")),
            ("entropy chunking", f"{'ok' if e['ok'] else 'FAILED'}: {e['tokens']} positions, max |diff| logp "
                                 f"{e['max_abs_diff']['logp']:.1e}, entropy {e['max_abs_diff']['entropy']:.1e}, "
                                 f"grad {e['max_abs_diff']['grad']:.1e}"),
            ("result", "ok" if result["ok"] else "FAILED")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    result = measure(a)
    print(table(result))
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
