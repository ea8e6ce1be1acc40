"""Rules the project installs on its Prefect server.

A flow run whose process dies outright (SIGKILL, out of memory, a lost machine) cannot report its own end, so the
server would show it Running forever. Every flow run sends a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
seconds (HEARTBEAT_S: prefect.toml's `flows.heartbeat_frequency`, which stages/core/env.py passes on and prefect.yaml's
work pools get generated); this automation marks a run Crashed once it has gone `after_s` seconds (CRASH_AFTER_S
unless `arpo server start --crash-after` says otherwise) without a heartbeat or a final state (Prefect's documented
zombie-flow recipe, docs/v3/advanced/detect-zombie-flows). The rerun then resumes: finished stages come from cache,
SFT and RL continue from their last checkpoints, and say so in their logs.
"""

from __future__ import annotations

from datetime import timedelta

from stages.core.env import prefect_settings

CRASH_AUTOMATION = "arpo: mark flow runs without heartbeats Crashed"
HEARTBEAT_S: int = prefect_settings()["flows"]["heartbeat_frequency"]
CRASH_AFTER_S = 6 * HEARTBEAT_S  # six missed heartbeats: a loaded 2-core box delays a beat, it does not skip six


def crash_silent_runs(api_url: str, after_s: int = CRASH_AFTER_S) -> None:
    """(Re)create the automation on the server at `api_url`."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if after_s <= 2 * HEARTBEAT_S:
        raise ValueError(f"crash detection after {after_s}s would crash healthy runs: they beat every {HEARTBEAT_S}s; "
                         f"give more than {2 * HEARTBEAT_S}s")
    beat, ends = "prefect.flow-run.heartbeat", ("Completed", "Failed", "Cancelled", "Crashed")
    with temporary_settings({PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            for old in client.read_automations_by_name(CRASH_AUTOMATION):
                client.delete_automation(old.id)
        Automation(
            name=CRASH_AUTOMATION,
            description=f"A flow run that sent heartbeats and then none for {after_s}s is marked Crashed.",
            trigger=EventTrigger(after={beat}, expect={beat, *(f"prefect.flow-run.{s}" for s in ends)},
                                 match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                                 for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                                 within=timedelta(seconds=after_s)),
            actions=[ChangeFlowRunState(state=StateType.CRASHED, message=(
                f"No heartbeat for {after_s}s: the process running this flow died (killed, out of memory, machine "
                "lost). Rerun it: finished stages come from cache, SFT and RL resume from their checkpoints."))],
        ).create()
