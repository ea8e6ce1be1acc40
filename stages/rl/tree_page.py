"""One step's rollout trees as a self-contained HTML page (inline CSS, SVG and a few lines of JavaScript: no server,
no network, opens from disk). How to read it: docs/ui.md ("Rollout trees").

Each group is drawn as lanes, one per trajectory, in tree order (a copy below its parent): x is the response token.
A lane shows the trajectory's own part: generated segments (blue bars), tool results (orange; red for an error,
grey when rejected, purple for an infrastructure failure), tokens the environment appended (grey), and above the
bar the entropy of its tokens along the way. A copy's lane starts where it forked; a line drops from the parent's
lane at the fork point (a black dot), whose marker tells the draw that made it (dH, the penalty counter c,
P(branch), u).
Draws that made no copy are hollow circles. The end of each lane tells the reward, advantage, finish reason and
answer. A click on a bar opens its text (and the tool result) below the drawing; a click on a lane's label opens
the trajectory's lines as `arpo trees` prints them. A very big step shows less text per piece (TEXT_BUDGET).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from stages.core.atomic import write_text
from stages.rl.trees import (
    STAT_LABELS,
    Node,
    Piece,
    TreeGroup,
    format_stat,
    group_header,
    node_header,
    segment_lines,
)

WIDTH, LEFT, RIGHT, LANE = 900, 78, 330, 36     # px: token axis, lane labels, leaf labels, lane height
MAX_TEXT = 6000                                 # characters of one piece shown (head and tail beyond that)
TEXT_BUDGET = 24_000_000                        # characters of text on one page: a big step's pieces share it
MIN_TEXT = 400                                  # ... but each piece keeps at least this much

CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 6px} h2{font-size:14px;margin:18px 0 4px}
.stats{display:flex;flex-wrap:wrap;gap:4px 18px;margin:8px 0 10px;max-width:1300px}
.stats span b{font-weight:600}
section.group{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 10px;margin:12px 0}
.gh{font-family:ui-monospace,monospace;white-space:pre-wrap;margin:0 0 6px;color:#333}
svg{display:block;max-width:100%;height:auto} svg text{font:11px ui-monospace,monospace;fill:#333}
.model{fill:#4a7fd0} .tool-ok{fill:#f0a030} .tool-error{fill:#d04040} .tool-rejected{fill:#999}
.tool-infra{fill:#8050c0} .env{fill:#bbb} .text{fill:#4a7fd0}
[data-detail]{cursor:pointer} rect[data-detail]:hover,rect.open{stroke:#000;stroke-width:1.5}
.lane-label:hover{text-decoration:underline}
.ent{fill:none;stroke:#2a9d5c;stroke-width:1.2} .link{fill:none;stroke:#888;stroke-width:1.2}
.fork{fill:#111;stroke:#fff} .nodraw{fill:#fff;stroke:#888} .axis{stroke:#ddd}
.detail,.traj{border-left:3px solid #4a7fd0;background:#f4f7fc;margin:6px 0;padding:4px 8px}
.traj{border-color:#2a9d5c;background:#f3faf6}
.detail pre,.traj pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:12px ui-monospace,monospace}
.legend span{display:inline-block;width:12px;height:8px;margin:0 4px 0 10px;vertical-align:middle}
"""

SCRIPT = """
document.addEventListener('click', function (event) {
  var hit = event.target.closest('[data-detail]');
  if (!hit) { return; }
  var box = document.getElementById(hit.getAttribute('data-detail'));
  if (!box) { return; }
  box.hidden = !box.hidden;
  hit.classList.toggle('open', !box.hidden);
  if (!box.hidden) { box.scrollIntoView({block: 'nearest'}); }
});
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def clip_text(text: str, limit: int = MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[… {len(text) - limit} characters not shown …]\n{text[-half:]}"


def lanes(g: TreeGroup) -> list[Node]:
    return g.nodes()


def piece_class(p: Piece) -> str:
    return f"tool-{p.status}" if p.kind == "tool" else p.kind


def piece_title(n: Node, p: Piece) -> str:
    if p.kind == "model":
        dh = n.delta(p)
        return f"#{n.traj_id} [{p.start},{p.end}) generated: H {p.h:.3f}" + ("" if dh is None else f", dH {dh:+.3f}")
    if p.kind == "tool":
        return f"#{n.traj_id} [{p.start},{p.end}) {p.tool} result #{p.call}: {p.status}"
    return f"#{n.traj_id} [{p.start},{p.end}) {'appended by the environment' if p.kind == 'env' else 'response'}"


def draw_title(n: Node, d: dict[str, Any]) -> str:
    made = f"made copy #{d['child']}" if d.get("branch") else "no copy"
    return (f"draw on #{n.traj_id} after call {d.get('call')} at token {d.get('at')}: H {d.get('h')} "
            f"(baseline {d.get('h0')}), dH {float(d.get('dh', 0)):+.3f}, c {d.get('c')}, P(branch) "
            f"{float(d.get('p', 0)):.3f}, u {float(d.get('u', 0)):.3f}: {made}")


def group_svg(gi: int, g: TreeGroup) -> str:
    order = lanes(g)
    lane_of = {n.traj_id: i for i, n in enumerate(order)}
    span = max([n.length for n in order] + [1])
    x = lambda t: LEFT + t * WIDTH / span
    y = lambda n: 14 + lane_of[n.traj_id] * LANE + LANE / 2
    h_max = max([h for n in order for h in n.tree.get("entropy", {}).get("h", []) if h is not None] + [1e-9])
    parts = [f'<svg class="tree" viewBox="0 0 {LEFT + WIDTH + RIGHT} {len(order) * LANE + 22}" '
             f'width="{LEFT + WIDTH + RIGHT}" role="img" aria-label="rollout tree of group {esc(g.group)}">',
             f'<line class="axis" x1="{LEFT}" y1="8" x2="{LEFT + WIDTH}" y2="8"/>',
             f'<text x="{LEFT}" y="7">0</text><text x="{LEFT + WIDTH - 40}" y="7">{span} tok</text>']
    for n in order:
        parts += node_svg(gi, n, x, y(n), y, h_max)
    parts.append("</svg>")
    return "\n".join(parts)


def node_svg(gi: int, n: Node, x, yn: float, y_of, h_max: float) -> list[str]:
    out = []
    label = {"branch": "copy"}.get(n.row.get("kind"), n.row.get("kind") or "?")
    out.append(f'<text class="lane-label" x="4" y="{yn + 4}" data-detail="t-{gi}-{n.traj_id}">#{n.traj_id} '
               f'{esc(label)}</text>')
    for p in n.pieces():
        out.append(f'<rect class="{piece_class(p)}" x="{x(p.start):.1f}" y="{yn + 4}" '
                   f'width="{max(1.5, x(p.end) - x(p.start)):.1f}" height="8" '
                   f'data-detail="d-{gi}-{n.traj_id}-{p.start}"><title>{esc(piece_title(n, p))}</title></rect>')
    out += entropy_svg(n, x, yn, h_max)
    for d in n.draws:
        if not d.get("branch"):
            out.append(f'<circle class="nodraw" cx="{x(int(d.get("at", 0))):.1f}" cy="{yn - 2}" r="3">'
                       f'<title>{esc(draw_title(n, d))}</title></circle>')
    for child in n.children:
        fork = next((d for d in n.draws if d.get("child") == child.traj_id), None)
        cx, cy = x(child.fork_at), y_of(child)
        out.append(f'<path class="link" d="M{cx:.1f},{yn + 8} V{cy + 8}"/>')
        title = draw_title(n, fork) if fork else f"copy #{child.traj_id} forked at token {child.fork_at}"
        out.append(f'<circle class="fork" cx="{cx:.1f}" cy="{yn + 8}" r="4.5"><title>{esc(title)}</title></circle>')
    answer = n.answer
    answer = "—" if answer is None else (answer if len(answer) <= 18 else answer[:18] + "…")
    out.append(f'<text x="{x(n.length) + 6:.1f}" y="{yn + 12}">r {n.reward:+.2f} A {n.advantage:+.2f} '
               f'{esc(n.row.get("finish_reason") or "?")} {esc(answer)}</text>')
    return out


def entropy_svg(n: Node, x, yn: float, h_max: float) -> list[str]:
    """The entropy curve of the node's own part (bins of model tokens), in the band above its bar; broken where a
    bin holds tool-result tokens only (they have no entropy)."""
    ent = n.tree.get("entropy") or {}
    size, values = int(ent.get("bin") or 1), ent.get("h") or []
    runs: list[list[str]] = [[]]
    for i, h in enumerate(values):
        if h is None or (i + 1) * size <= n.fork_at:
            runs.append([])
            continue
        runs[-1].append(f"{x(i * size + size / 2):.1f},{yn + 2 - 14 * h / h_max:.1f}")
    path = " ".join("M" + " L".join(run) for run in runs if len(run) >= 2)
    if not path:
        return []
    return [f'<path class="ent" d="{path}"><title>token entropy of #{n.traj_id} (bins of {size} tokens; highest in '
            f'this group {h_max:.3f})</title></path>']


def text_limit(groups: list[TreeGroup]) -> int:
    """Characters shown per piece: MAX_TEXT, less on a step so big that its text would pass TEXT_BUDGET (the dump
    and `arpo trees` keep all of it)."""
    pieces = sum(len(n.pieces()) for g in groups for n in g.nodes())
    return max(MIN_TEXT, min(MAX_TEXT, TEXT_BUDGET // max(1, pieces)))


def details_html(gi: int, g: TreeGroup, limit: int = MAX_TEXT) -> str:
    """Hidden boxes a click opens: per trajectory its header and segment lines, per piece its text and draws."""
    out = []
    for n in lanes(g):
        lines = "\n".join(line for _, line in segment_lines(n))
        out.append(f'<div class="traj" id="t-{gi}-{n.traj_id}" hidden><b>{esc(node_header(n))}</b>'
                   f'<pre>{esc(lines)}</pre></div>')
        for p in n.pieces():
            draws = [d for d in n.draws if int(d["seg"][0]) == p.start] if p.kind == "model" else []
            extra = "".join(f"<div>{esc(draw_title(n, d))}</div>" for d in draws)
            out.append(f'<div class="detail" id="d-{gi}-{n.traj_id}-{p.start}" hidden><b>{esc(piece_title(n, p))}'
                       f'</b>{extra}<pre>{esc(clip_text(p.text, limit))}</pre></div>')
    return "\n".join(out)


def stats_html(stats: dict[str, float | None]) -> str:
    items = "".join(f"<span>{esc(label)} <b>{esc(format_stat(key, stats.get(key)))}</b></span>"
                    for key, label, _ in STAT_LABELS)
    return f'<div class="stats">{items}</div>'


def page_html(title: str, source: str, groups: list[TreeGroup], stats: dict[str, float | None]) -> str:
    legend = "".join(f'<span class="{cls}" style="background:{color}"></span>{esc(name)}' for cls, color, name in (
        ("model", "#4a7fd0", "generated"), ("tool-ok", "#f0a030", "tool result"),
        ("tool-error", "#d04040", "tool error"), ("env", "#bbb", "appended by the environment"),
        ("ent", "#2a9d5c", "token entropy"), ("fork", "#111", "fork (the draw that made the copy)")))
    sections, limit = [], text_limit(groups)
    for gi, g in enumerate(groups):
        sections.append(f'<section class="group" id="group-{gi}"><div class="gh">'
                        f'{esc(chr(10).join(group_header(g)))}</div>{group_svg(gi, g)}'
                        f'<div class="details">{details_html(gi, g, limit)}</div></section>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<link rel="icon" href="data:,"><style>{CSS}</style></head><body><h1>{esc(title)}</h1>'
            f'<div>from <code>{esc(source)}</code>; hover a mark for its numbers, click a bar for its text, a lane '
            f'label for its lines</div>{stats_html(stats)}<div class="legend">{legend}</div>'
            f'{"".join(sections)}<script>{SCRIPT}</script></body></html>')


def write_page(path: Path, title: str, source: str, groups: list[TreeGroup],
               stats: dict[str, float | None]) -> Path:
    return write_text(path, page_html(title, source, groups, stats))
