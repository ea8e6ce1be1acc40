"""Pre-flight check, run in a fresh interpreter of verl's environment before Ray starts:

    python -m stages.rl.verl.preflight        -> prints JSON {"ok": bool, "found": {...}, "error": str | null}

It imports only `verl` (so the plugin arrives the way every Ray worker gets it: the `verl.plugins` entry point or
VERL_USE_EXTERNAL_MODULES) and then looks our names up in verl's registries. verl swallows plugin import errors, so
when a name is missing the plugin is imported once more directly to report the real error.
"""

from __future__ import annotations

import json
import traceback


def main() -> dict:
    import verl  # noqa: F401  (loads plugins)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from stages.rl.verl.mapping import (
        ADV_ESTIMATOR,
        POLICY_LOSSES,
        TRAINER_MODE,
        TREE_AGENT,
    )

    found = {f"adv:{ADV_ESTIMATOR}": ADV_ESTIMATOR in ADV_ESTIMATOR_REGISTRY,
             f"agent_loop:{TREE_AGENT}": TREE_AGENT in _agent_loop_registry,
             f"trainer:{TRAINER_MODE}": TRAINER_MODE in TRAINER_REGISTRY,
             **{f"loss:{name}": name in POLICY_LOSS_REGISTRY for name in POLICY_LOSSES.values()}}
    error = None
    if not all(found.values()):
        try:
            import stages.rl.verl.plugin  # noqa: F401
        except Exception:  # noqa: BLE001  (any import error is the report)
            error = traceback.format_exc(limit=6)
        else:
            error = ("the plugin imports fine here but `import verl` did not load it: install this project into "
                     "verl's environment (entry point verl.plugins) or set VERL_USE_EXTERNAL_MODULES="
                     "stages.rl.verl.plugin")
    return {"ok": all(found.values()), "found": found, "error": error}


if __name__ == "__main__":
    print(json.dumps(main()))
