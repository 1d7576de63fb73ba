# SPDX-License-Identifier: Apache-2.0
"""Draws the package-level import graph of ``dist_attn`` (docs/import_graph.svg, shown in
docs/layout.md), read from the source with ast by the same code as the layout tests
(``tests/_imports.py``: imports inside functions count).

    python docs/import_graph.py            # from the repository root; needs matplotlib

Each box is a group of modules (:func:`group`); an arrow A -> B says a module of A imports one of
B. Boxes stand in floors: a box stands above every box it imports (the ground floor imports
nothing of dist_attn). The model band (``dist_attn.models``) lies above the library band; an arrow
that ran up, or out of the library into the model band, would be drawn red.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests._imports import import_graph, package_modules  # noqa: E402

__all__ = ["group", "package_graph", "main"]

OUT = os.path.join(ROOT, "docs", "import_graph.svg")
#: The library's top-level modules drawn as one box each; the rest share "core helpers".
_OWN_BOX = {"ulysses", "ring", "varlen", "weight_sharding", "_moved"}
#: The box of the library's other top-level modules, the ground floor.
_GROUND = "core helpers"
#: Height of one floor, in inches.
_STEP = 0.8


def group(module: str) -> str | None:
    """The box of ``module``: a serve sub-package, H3's fp8 or activations, a library package, an
    own-box module or the core helpers; None for the faces that import nothing (``dist_attn.models``,
    ``dist_attn.models.h3``)."""
    parts = module.split(".")[1:]
    if parts[:2] == ["models", "h3"]:
        if len(parts) == 2:
            return None
        if parts[2] == "serve":
            return "h3.serve" if len(parts) == 3 or parts[3] == "__main__" else f"h3.serve.{parts[3]}"
        return f"h3.{parts[2]}"
    if parts[:1] == ["models"]:
        return None
    if not parts:
        return "dist_attn (face)"
    if parts[0] == "kernels":
        return "kernels.sage8" if parts[1:2] == ["sage8"] else "kernels"
    if parts[0] in ("backends", "integrations"):
        return "integrations.diffusers" if parts[0] == "integrations" else "backends"
    return parts[0] if parts[0] in _OWN_BOX else _GROUND


def _helpers() -> list[str]:
    """The modules in the ground box, by their short names."""
    return sorted(m.rpartition(".")[2] for m in package_modules("dist_attn") if group(m) == _GROUND)


def package_graph() -> dict[str, set[str]]:
    """Box -> the boxes its modules import."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph(package_modules("dist_attn")).items():
        src = group(module)
        if src is None:
            continue
        graph.setdefault(src, set()).update(g for t in imported if (g := group(t)) not in (None, src))
    return graph


def _is_model(box: str) -> bool:
    return box.startswith("h3.")


def _floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Box -> floor: a library box one above the highest library box it imports (0: none); a model
    box above every library floor, one above the highest model box it imports."""
    floor: dict[str, int] = {}

    def of(box: str, model: bool) -> int:
        if box not in floor:
            below = [of(t, model) for t in sorted(graph.get(box, ())) if _is_model(t) == model]
            floor[box] = 1 + max(below, default=-1)
        return floor[box]

    for box in sorted(graph):
        of(box, _is_model(box))
    base = 1 + max(f for b, f in floor.items() if not _is_model(b))
    return {b: f + base if _is_model(b) else f for b, f in floor.items()}


def _columns(graph: dict[str, set[str]], floor: dict[str, int], sweeps: int = 6) -> dict[str, float]:
    """Box -> x, in slots of one box: each floor centred, its boxes ordered by the mean x of the
    boxes they are tied to (a few barycentre sweeps, which uncross most arrows)."""
    ties: dict[str, set[str]] = {b: set(graph.get(b, ())) for b in floor}
    for src, dsts in graph.items():
        for dst in dsts:
            ties[dst].add(src)
    rows: dict[int, list[str]] = {}
    for box in sorted(floor):
        rows.setdefault(floor[box], []).append(box)
    x: dict[str, float] = {}

    def place(f: int) -> None:
        for i, box in enumerate(rows[f]):
            x[box] = i - (len(rows[f]) - 1) / 2

    for f in rows:
        place(f)
    for sweep in range(sweeps):
        for f in sorted(rows, reverse=sweep % 2 == 0):
            rows[f].sort(key=lambda b: sum(x[t] for t in ties[b]) / len(ties[b]) if ties[b] else x[b])
            place(f)
    return x


def main(out: str = OUT) -> str:
    """Draws the graph to ``out`` (its format from the suffix, SVG by default); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a small, diffable file
    matplotlib.rcParams["svg.hashsalt"] = "dist_attn"  # the same ids on every run
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    # the core helpers are imported by nearly every box: a ground slab, its arrows left out
    graph = {b: {t for t in ts if t != _GROUND} for b, ts in package_graph().items() if b != _GROUND}
    floor = _floors(graph)
    column = _columns(graph, floor)
    top, slot, box_w, box_h = max(floor.values()), 2.3, 2.0, 0.42
    width = slot * max(5, 1 + max(sum(1 for b in floor if floor[b] == f) for f in range(top + 1)))
    pos = {b: (width / 2 + column[b] * slot, (floor[b] + 1) * _STEP) for b in sorted(floor)}
    height = (top + 1) * _STEP
    fig, ax = plt.subplots(figsize=(width + 0.4, height + 1.4))
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-0.5, height + 0.7)
    ax.axis("off")
    split = (min(floor[b] for b in floor if _is_model(b)) + 0.5) * _STEP
    for y0, y1, label, color in ((-0.45, split - 0.03, "generic library (dist_attn)", "#eef3f8"),
                                 (split + 0.03, height + 0.45, "dist_attn.models.h3", "#f6efe6")):
        ax.add_patch(FancyBboxPatch((-0.1, y0), width + 0.2, y1 - y0, boxstyle="round,pad=0.02",
                                    fc=color, ec="none", zorder=0))
        ax.text(0.0, y1 - 0.12, label, fontsize=10, color="#555555", va="top", zorder=1)
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            (x0, y0), (x1, y1) = pos[src], pos[dst]
            bad = floor[dst] >= floor[src] or (_is_model(dst) and not _is_model(src))
            skip = floor[src] - floor[dst]
            # an arrow past a floor bows aside, off the boxes in between (left or right by floors)
            rad = 0.0 if skip < 2 or abs(x1 - x0) > slot / 2 else (0.35 if skip % 2 else -0.35)
            ax.add_patch(FancyArrowPatch((x0, y0 - box_h / 2), (x1, y1 + box_h / 2),
                                         arrowstyle="-|>", mutation_scale=8, lw=0.6,
                                         connectionstyle=f"arc3,rad={rad}",
                                         color="#d62728" if bad else "#8a8f98", zorder=2))
    for box, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h,
                                    boxstyle="round,pad=0.02", zorder=3,
                                    fc="#f3d9b1" if _is_model(box) else "#c9d9ea", ec="#4d4d4d", lw=0.6))
        ax.text(x, y, box, ha="center", va="center", fontsize=8, zorder=4)
    ax.add_patch(FancyBboxPatch((0.2, -0.35), width - 0.4, box_h + 0.1, boxstyle="round,pad=0.02",
                                fc="#c9d9ea", ec="#4d4d4d", lw=0.6, zorder=3))
    ax.text(width / 2, -0.35 + (box_h + 0.1) / 2, f"{_GROUND}: {', '.join(_helpers())}\n"
            "(imported by nearly every box above; those arrows are not drawn)",
            ha="center", va="center", fontsize=8, zorder=4)
    ax.set_title("dist_attn import graph by package (an arrow: imports; every arrow points down)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None} if out.endswith(".svg") else None)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
