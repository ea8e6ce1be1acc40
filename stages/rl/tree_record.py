"""What a rollout dump row carries of its tree (both engines): the decisions behind each branch, the segments and tool
results, the entropy along the trajectory, and how many of its loss tokens are a shared prefix trained again.

The rollout records as it goes (stages/rl/rollout.py `record_draw`, stages/generation/tool_rollout.py's
`tool_spans`, rollout_state.py's `segments`); `trajectory_record` gathers that into one JSON-able dict per
trajectory. The local trainer's dump (stages/rl/step_metrics.py `dump_rollouts`) adds it to each row through
`trajectory_tree_fields`; verl's tree loop sends it through verl as the `arpo_tree` extra field (JSON text,
stages/rl/verl/tree.py) and our trainer mode's dump adds it through `extra_tree_fields`. Both end as the same row
fields, read by stages/rl/trees.py:

    loss_tokens                 tokens of the row the loss trains (0 for a row an infrastructure failure masked)
    retrained_prefix_tokens     of those, the ones before `fork_at`: a copy of its parent's tokens, trained again
    tree.segments               [start, end, after_result, H] per generated segment (a copy's include its prefix)
    tree.tool_spans             [start, end, tool, status, call] per tool result (status ok|error|rejected|infra)
    tree.draws                  one per branch draw on this trajectory: the measured segment `seg`, its H `h`, the
                                baseline `h0`, dH `dh`, AEPO's penalty counter `c`, u, P(branch) `p`, `branch`,
                                the copy it made `child`, where a copy forks `at` and after which tool call `call`
    tree.fork_call              tool calls in the shared prefix of a copy (the call its fork follows)
    tree.forced_eos             where the environment appended an EOS (call limit, empty call), if it did
    tree.entropy                {"bin": tokens per bin, "h": mean entropy of the model tokens of each bin}
    tree.group                  n, initial roots, copies, fresh roots and, with AEPO's probe, H_root / H_tool
    tree.chars                  [token, character] pairs: where each boundary above falls in `response`
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from stages.generation.types import RolloutGroup, Trajectory

ENTROPY_BINS = 96     # points of the entropy curve per trajectory: enough to see a segment, a few KB per row
TREE_FIELD = "arpo_tree"  # verl extra field carrying `trajectory_record` as JSON text


def entropy_bins(entropies: Sequence[float], mask: Sequence[int], bins: int = ENTROPY_BINS) -> dict[str, Any]:
    """The per-token entropy averaged over the model tokens (mask 1) of consecutive bins of `ceil(len / bins)`
    tokens; a bin of tool-result tokens only is None (they have no entropy)."""
    size = max(1, math.ceil(len(entropies) / bins))
    values: list[float | None] = []
    for start in range(0, len(entropies), size):
        picked = [h for h, m in zip(entropies[start:start + size], mask[start:start + size]) if m]
        values.append(round(sum(picked) / len(picked), 4) if picked else None)
    return {"bin": size, "h": values}


def group_info(group: RolloutGroup) -> dict[str, Any]:
    info: dict[str, Any] = {"n": len(group.trajectories), "initial": group.initial_rollouts,
                            "branches": group.branches, "fresh": group.fresh}
    for key in ("h_root", "h_tool"):  # AEPO's probe ran: it set `initial` from these
        if group.meta.get(key) is not None:
            info[key] = round(float(group.meta[key]), 6)
    return info


def trajectory_record(traj: Trajectory, group: RolloutGroup) -> dict[str, Any]:
    """The tree data of one trajectory of a finished rollout (JSON-able)."""
    meta = traj.meta
    h_initial = meta.get("h_initial")
    return {"segments": meta.get("segments", []), "tool_spans": meta.get("tool_spans", []),
            "draws": meta.get("draws", []),
            "h_initial": None if h_initial is None else round(float(h_initial), 6),
            "fork_call": int(meta.get("inherited_tool_calls", 0)) if traj.parent_id is not None else 0,
            "forced_eos": meta.get("forced_eos"),
            "entropy": entropy_bins(traj.entropies, traj.loss_mask), "group": group_info(group)}


def boundaries(record: dict[str, Any], fork_at: int, length: int) -> list[int]:
    """Token positions where a piece of the tree starts or ends."""
    points = {0, length, fork_at}
    for start, end, *_ in record.get("segments", []) + record.get("tool_spans", []):
        points.update((int(start), int(end)))
    if record.get("forced_eos") is not None:
        points.add(int(record["forced_eos"]))
    return sorted(p for p in points if 0 <= p <= length)


def tree_fields(record: dict[str, Any], response_ids: Sequence[int], train_mask: Sequence[int], fork_at: int,
                shared: bool, tokenizer: Any) -> dict[str, Any]:
    """The dump row's tree fields (module docstring). `train_mask`: the row's loss mask as the update uses it;
    `shared`: the row is a copy whose first `fork_at` tokens are its parent's. Character offsets come from
    decoding each prefix as the response itself is decoded (skip_special_tokens)."""
    ids = [int(t) for t in response_ids]
    chars = [[p, len(tokenizer.decode(ids[:p], skip_special_tokens=True))] for p in boundaries(record, fork_at,
                                                                                               len(ids))]
    return {"loss_tokens": int(sum(train_mask)),
            "retrained_prefix_tokens": int(sum(train_mask[:fork_at])) if shared else 0,
            "tree": {**record, "chars": chars}}


def trajectory_tree_fields(traj: Trajectory, group: RolloutGroup, tokenizer: Any) -> dict[str, Any]:
    """The local engine's row: the update trains the loss mask, none of it for a masked row (stages/rl/update.py)."""
    train = [0] * len(traj.loss_mask) if traj.masked else traj.loss_mask
    return tree_fields(trajectory_record(traj, group), traj.response_ids, train, traj.fork_at,
                       traj.parent_id is not None, tokenizer)


def extra_tree_fields(extra: dict[str, Any], response_ids: Sequence[int], response_mask: Sequence[int],
                      tokenizer: Any) -> dict[str, Any]:
    """verl's row: the record from the tree loop's extra fields; verl trains `response_mask` (all zero for a
    masked row: stages/rl/verl/tree.py)."""
    text = extra.get(TREE_FIELD)
    if not text:
        raise ValueError(f"a verl rollout row has no '{TREE_FIELD}' extra field: it was not produced by our "
                         "arpo_tree agent loop (stages/rl/verl/tree.py)")
    return tree_fields(json.loads(text), response_ids, response_mask, int(extra.get("arpo_fork_at", 0)),
                       int(extra.get("arpo_parent", -1)) >= 0, tokenizer)
