"""ARPO / AEPO rollout trees from the rollout dumps (`<rl stage>/rollouts/step_<k>.jsonl`, either engine): the tree
of each group, its pieces (generated segments, tool results, tokens the environment appended), its text form and a
step's summary statistics. Pure functions over the dump rows (fields: stages/rl/tree_record.py); the HTML page is
stages/rl/tree_page.py, the command `arpo trees` is `trees_report`.

A group is a forest: roots (and fresh roots) start from the prompt; a copy (kind `branch`) shares its parent's
first `fork_at` response tokens and continues on its own. A node's own part is [fork_at, length) (a root's is the
whole response); the copies of a node hang off it at their fork points.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from stages.agent.protocol import extract_answer
from stages.core.atomic import read_jsonl
from stages.core.errors import BadInputError

DUMP_NAME = re.compile(r"^step_(\d+)\.jsonl$")


@dataclass(frozen=True)
class Piece:
    """A span [start, end) of a trajectory's own part: `model` (a generated segment, H its window entropy),
    `tool` (a tool result: tool, status, call number), `env` (tokens the environment appended, e.g. a forced EOS)
    or `text` (a dump without tree fields: the whole own part)."""

    start: int
    end: int
    kind: str
    text: str
    h: float | None = None
    after_result: bool = False
    tool: str = ""
    status: str = ""
    call: int = 0


@dataclass
class Node:
    row: dict[str, Any]
    children: list[Node] = field(default_factory=list)
    depth: int = 0

    @property
    def traj_id(self) -> int:
        return int(self.row["traj_id"])

    @property
    def parent_id(self) -> int | None:
        parent = self.row.get("parent_id")
        return None if parent is None or int(parent) < 0 else int(parent)

    @property
    def fork_at(self) -> int:
        return int(self.row.get("fork_at") or 0) if self.parent_id is not None else 0

    @property
    def tree(self) -> dict[str, Any]:
        return self.row.get("tree") or {}

    @property
    def reward(self) -> float:
        return float((self.row.get("reward") or {}).get("score", 0.0))

    @property
    def advantage(self) -> float:
        return float(self.row.get("advantage") or 0.0)

    @property
    def answer(self) -> str | None:
        reward = self.row.get("reward") or {}
        return reward["answer"] if "answer" in reward else extract_answer(self.row.get("response") or "")

    @property
    def draws(self) -> list[dict[str, Any]]:
        return list(self.tree.get("draws", []))

    @property
    def length(self) -> int:
        return int(self.row.get("length") or 0)

    @cached_property
    def _chars(self) -> dict[int, int]:
        return {int(t): int(c) for t, c in self.tree.get("chars", [])}

    def text(self, start: int, end: int) -> str:
        """The response text of tokens [start, end) (character offsets from the dump's `tree.chars`)."""
        chars = self._chars
        response = self.row.get("response") or ""
        if start not in chars or end not in chars:
            return response if (start, end) == (self.fork_at, self.length) or not chars else ""
        return response[chars[start]:chars[end]]

    def pieces(self) -> list[Piece]:
        """The node's own part in order: its segments, tool results and the gaps between them."""
        return list(self._pieces)

    @cached_property
    def _pieces(self) -> list[Piece]:
        tree, start = self.tree, self.fork_at
        if not tree:
            return [Piece(start, self.length, "text", self.text(start, self.length))] if self.length > start else []
        spans = [Piece(int(s), int(e), "model", "", h=float(h), after_result=bool(a))
                 for s, e, a, h in tree.get("segments", []) if int(s) >= start]
        spans += [Piece(int(s), int(e), "tool", "", tool=str(tool), status=str(status), call=int(call))
                  for s, e, tool, status, call in tree.get("tool_spans", []) if int(s) >= start]
        spans.sort(key=lambda p: (p.start, p.end))
        out, at = [], start
        for p in spans:
            if p.start > at:
                out.append(Piece(at, p.start, "env", self.text(at, p.start)))
            out.append(Piece(p.start, p.end, p.kind, self.text(p.start, p.end), p.h, p.after_result, p.tool,
                             p.status, p.call))
            at = max(at, p.end)
        if self.length > at:
            out.append(Piece(at, self.length, "env", self.text(at, self.length)))
        return out

    def delta(self, piece: Piece) -> float | None:
        """dH of a generated segment against the trajectory's baseline; None when it is the baseline (a root's
        first segment; a copy's first own one that set its baseline, the reference window) or there is none."""
        h0 = self.tree.get("h_initial")
        if piece.h is None or h0 is None:
            return None
        first = next((p for p in self._pieces if p.kind == "model"), None)
        if first is not None and first.start == piece.start and (self.parent_id is None or piece.h == float(h0)):
            return None
        return piece.h - float(h0)

    def walk(self) -> Iterable[Node]:
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass
class TreeGroup:
    group: str
    question: str
    ground_truth: str
    info: dict[str, Any]
    roots: list[Node]

    def nodes(self) -> list[Node]:
        return [n for root in self.roots for n in root.walk()]

    @property
    def depth(self) -> int:
        return max((n.depth for n in self.nodes()), default=0)


def build_trees(rows: list[dict[str, Any]], source: str = "rows") -> list[TreeGroup]:
    """The groups of one step's dump rows, in the dump's order; children by fork point, then creation order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for i, row in enumerate(rows, 1):
        missing = [k for k in ("group", "traj_id") if k not in row]
        if missing:
            raise BadInputError(f"{source} row {i} has no {', '.join(missing)}: not a rollout dump row "
                                "(stages/rl/step_metrics.py dump_rollouts writes them)")
        groups.setdefault(str(row["group"]), []).append(row)
    return [_tree(gid, members) for gid, members in groups.items()]


def _tree(gid: str, rows: list[dict[str, Any]]) -> TreeGroup:
    nodes = {int(r["traj_id"]): Node(r) for r in rows}
    roots = []
    for node in sorted(nodes.values(), key=lambda n: n.traj_id):
        parent = nodes.get(node.parent_id) if node.parent_id is not None else None
        (parent.children if parent is not None else roots).append(node)
    for root in roots:
        for child_of in root.walk():
            child_of.children.sort(key=lambda n: (n.fork_at, n.traj_id))
            for child in child_of.children:
                child.depth = child_of.depth + 1
    first = rows[0]
    info = dict((first.get("tree") or {}).get("group") or {})
    info.setdefault("n", len(rows))
    return TreeGroup(gid, str(first.get("question") or ""), str(first.get("ground_truth") or ""), info, roots)


# ---- summary statistics ----------------------------------------------------------------------------------------

def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_stats(groups: list[TreeGroup]) -> dict[str, float | None]:
    """Per step: groups and trajectories; roots, copies and fresh roots per group; tree depth (a root is 0, a copy
    its parent's + 1: mean of the groups' deepest, and the deepest); the share of trained tokens that are a shared
    prefix trained again; the reward spread between siblings (a node and its copies: max - min reward, mean over
    the families, and the share of families where it is not 0, i.e. where branching found a reward difference);
    the branch draws, the share that made a copy, and their mean dH and P(branch)."""
    nodes = [n for g in groups for n in g.nodes()]
    kinds = [[n.row.get("kind") for n in g.nodes()] for g in groups]
    loss = [n.row["loss_tokens"] for n in nodes if "loss_tokens" in n.row]
    retrained = [n.row.get("retrained_prefix_tokens", 0) for n in nodes if "loss_tokens" in n.row]
    spreads = [max(f) - min(f) for f in ([n.reward] + [c.reward for c in n.children] for n in nodes
                                          if n.children)]
    draws = [d for n in nodes for d in n.draws]
    return {
        "groups": float(len(groups)), "trajectories": float(len(nodes)),
        "roots_per_group": _mean([float(k.count("root")) for k in kinds]),
        "branches_per_group": _mean([float(k.count("branch")) for k in kinds]),
        "fresh_per_group": _mean([float(k.count("fresh")) for k in kinds]),
        "depth_mean": _mean([float(g.depth) for g in groups]),
        "depth_max": float(max((g.depth for g in groups), default=0)),
        "retrained_prefix_share": sum(retrained) / sum(loss) if loss and sum(loss) else None,
        "sibling_reward_spread": _mean(spreads),
        "families_with_spread": _mean([float(s > 0) for s in spreads]),
        "draws": float(len(draws)),
        "draw_branch_rate": _mean([float(bool(d.get("branch"))) for d in draws]),
        "draw_dh_mean": _mean([float(d["dh"]) for d in draws if d.get("dh") is not None]),
        "draw_p_mean": _mean([float(d["p"]) for d in draws if d.get("p") is not None]),
        "reward_mean": _mean([n.reward for n in nodes]),
    }


STAT_LABELS = (("groups", "groups", "{:.0f}"), ("trajectories", "trajectories", "{:.0f}"),
               ("roots_per_group", "roots/group", "{:.2f}"), ("branches_per_group", "copies/group", "{:.2f}"),
               ("fresh_per_group", "fresh/group", "{:.2f}"), ("depth_mean", "depth mean", "{:.2f}"),
               ("depth_max", "depth max", "{:.0f}"), ("retrained_prefix_share", "retrained prefix", "{:.1%}"),
               ("sibling_reward_spread", "sibling reward spread", "{:.3f}"),
               ("families_with_spread", "families with spread", "{:.0%}"), ("draws", "draws", "{:.0f}"),
               ("draw_branch_rate", "draws that branched", "{:.0%}"), ("draw_dh_mean", "mean dH drawn", "{:+.3f}"),
               ("draw_p_mean", "mean P(branch)", "{:.2f}"), ("reward_mean", "reward mean", "{:.3f}"))


def format_stat(key: str, value: float | None) -> str:
    fmt = next((f for k, _, f in STAT_LABELS if k == key), "{}")
    return "n/a" if value is None else fmt.format(value)


# ---- text ------------------------------------------------------------------------------------------------------

def _draw_text(d: dict[str, Any]) -> str:
    made = f"→ #{d['child']}" if d.get("branch") else "no copy"
    return f"c {d.get('c', 0)} p {float(d.get('p', 0.0)):.2f} u {float(d.get('u', 0.0)):.2f} {made}"


def node_header(n: Node) -> str:
    fork = ""
    if n.parent_id is not None:
        fork = f" of #{n.parent_id} @{n.fork_at} after call {(n.tree or {}).get('fork_call', '?')}"
    loss = ""
    if "loss_tokens" in n.row:
        loss = f" · loss {n.row['loss_tokens']} tok ({n.row.get('retrained_prefix_tokens', 0)} retrained)"
    answer = n.answer
    answer = "none" if answer is None else json.dumps(answer if len(answer) <= 40 else answer[:40] + "…",
                                                      ensure_ascii=False)
    return (f"#{n.traj_id} {n.row.get('kind', '?')}{fork} · reward {n.reward:+.2f} · adv {n.advantage:+.3f} · "
            f"{n.row.get('finish_reason') or '?'} · answer {answer}{loss}")


def segment_lines(n: Node) -> list[tuple[int, str]]:
    """(end token, line) per segment of the node's own part: a generated segment with the tool call it ends in and
    its result on one line, its entropy (H, dH) and the branch draws it decided."""
    lines: list[tuple[int, str]] = []
    pieces = n.pieces()
    draws_at = {}
    for d in n.draws:
        draws_at.setdefault(int(d["seg"][0]), []).append(d)
    i = 0
    while i < len(pieces):
        p = pieces[i]
        if p.kind == "model":
            dh = n.delta(p)
            text = f"[{p.start},{p.end}) H {p.h:.3f} " + ("(baseline)" if dh is None else f"dH {dh:+.3f}")
            if i + 1 < len(pieces) and pieces[i + 1].kind == "tool" and pieces[i + 1].start == p.end:
                i += 1
                t = pieces[i]
                text += f" → {t.tool} #{t.call} {t.status} [{t.start},{t.end})"
            if p.start in draws_at:
                text += " | draws: " + "; ".join(_draw_text(d) for d in draws_at[p.start])
        elif p.kind == "tool":
            text = f"[{p.start},{p.end}) result {p.tool} #{p.call} {p.status}"
        else:
            text = f"[{p.start},{p.end}) {'environment' if p.kind == 'env' else 'response'} ({p.end - p.start} tok)"
        lines.append((pieces[i].end, text))
        i += 1
    return lines


def render_node(n: Node, indent: str = "") -> list[str]:
    out = [indent + node_header(n)]
    pending = list(n.children)
    for child in [c for c in pending if c.fork_at <= n.fork_at]:
        out += render_node(child, indent + "    ")
        pending.remove(child)
    for end, line in segment_lines(n):
        out.append(indent + "  " + line)
        for child in [c for c in pending if c.fork_at == end]:
            out += render_node(child, indent + "    ")
            pending.remove(child)
    for child in pending:  # a fork point that is no piece boundary (a dump without tree fields)
        out += render_node(child, indent + "    ")
    return out


def group_header(g: TreeGroup) -> list[str]:
    info = g.info
    kinds = [n.row.get("kind") for n in g.nodes()]
    line = (f"group {g.group} · n {info.get('n', len(kinds))} · roots {kinds.count('root')} · copies "
            f"{kinds.count('branch')} · fresh {kinds.count('fresh')} · depth {g.depth}")
    if "h_root" in info:
        line += f" · probe H_root {info['h_root']:.3f} H_tool {info.get('h_tool', 0.0):.3f} → {info.get('initial')} roots"
    question = g.question if len(g.question) <= 200 else g.question[:200] + "…"
    return [line, f"  Q: {question}", f"  gold: {g.ground_truth}"]


def render_group(g: TreeGroup) -> str:
    lines = group_header(g)
    for root in g.roots:
        lines += render_node(root, "  ")
    return "\n".join(lines)


# ---- dumps on disk -----------------------------------------------------------------------------------------------

def dump_files(rollouts: Path) -> dict[int, Path]:
    """step -> dump file, in step order (verl names them step_<k>.jsonl, the local trainer step_<k:06d>.jsonl)."""
    found = {int(m.group(1)): p for p in Path(rollouts).glob("step_*.jsonl") if (m := DUMP_NAME.match(p.name))}
    return dict(sorted(found.items()))


def read_step(path: Path) -> list[TreeGroup]:
    return build_trees(read_jsonl(path), str(path))
