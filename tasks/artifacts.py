"""Publishing to the Prefect UI. Outside a flow run these are no-ops, so stages stay testable alone.

The synchronous implementations are forced (`_sync=True`): a stage may report from inside an event loop (inference),
where Prefect would otherwise hand back an un-awaited coroutine."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.context import get_run_context


def _in_run() -> bool:
    try:
        get_run_context()
        return True
    except Exception:  # noqa: BLE001 - no run context is signalled by several exception types
        return False


def artifact_key(text: str) -> str:
    # artifact keys: lowercase letters, numbers, dashes
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def publish_table(key: str, rows: list[dict[str, Any]], description: str = "") -> None:
    if _in_run() and rows:
        create_table_artifact(table=rows, key=artifact_key(key), description=description, _sync=True)


def publish_markdown(key: str, markdown: str, description: str = "") -> None:
    if _in_run():
        create_markdown_artifact(markdown=markdown, key=artifact_key(key), description=description, _sync=True)


def publish_image(key: str, png: str | Path, description: str = "") -> None:
    """An image as a markdown artifact with the PNG inlined, so the UI shows it without a file server."""
    path = Path(png)
    if _in_run() and path.is_file():
        data = base64.b64encode(path.read_bytes()).decode()
        publish_markdown(key, f"![{path.stem}](data:image/png;base64,{data})\n\n`{path}`", description)
