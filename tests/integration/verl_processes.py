"""The processes of one verl run, found by the settings path our launcher puts into every one's environment: the
verl tests check that a run (killed, finished or cached) leaves none behind."""

from __future__ import annotations

from pathlib import Path

AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # outlive their raylet; the next attempt reaps them


def verl_processes(stage: Path, agents: bool = True) -> list[int]:
    """Processes of the verl run of `stage` (the RL stage folder); Ray's agents only with `agents`."""
    marker = f"ARPO_VERL_SETTINGS={stage / 'verl_inputs' / 'plugin_settings.json'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes():
                if agents or not (entry / "cmdline").read_bytes().decode(errors="replace").startswith(AGENTS):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found
