"""Units and colours every view shares: SI counts, binary byte units, milliseconds, padded
columns, HTML escaping, and the colour of each stage."""

from __future__ import annotations

import html

KIB, MIB, GIB = 2**10, 2**20, 2**30


STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                 "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")


def stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def si(value: float) -> str:
    """1234567 -> '1.23M' (for counts and FLOPs; the unit sits in the column header)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit a column of byte counts is written in, chosen by its largest entry."""
    if largest >= GIB:
        return "GiB", GIB
    if largest >= MIB:
        return "MiB", MIB
    return "KiB", KIB


def human_bytes(num_bytes: float) -> str:
    unit, scale = byte_unit(num_bytes)
    if num_bytes < KIB:
        return f"{num_bytes:.0f} B"
    return f"{num_bytes / scale:.1f} {unit}" if num_bytes / scale < 1000 else f"{num_bytes / scale:.0f} {unit}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def held(names) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def render_columns(header: list[str], units: list[str], rows: list[list[str]], align: str) -> list[str]:
    """Columns padded to their widest cell; ``align`` is one '<' or '>' per column."""
    widths = [max(len(c) for c in col) for col in zip(header, units, *rows)]

    def line(cells):
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()

    out = [line(header)]
    if any(units):
        out.append(line(units))
    out += [line(r) for r in rows]
    return out


def escape(text) -> str:
    return html.escape(str(text), quote=True)

