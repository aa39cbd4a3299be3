"""`perf_stats.svg`: median time per valid config as horizontal bars, fastest first, with min-max whiskers,
and the invalid configs listed with their reasons. Plain SVG text, so a bundle needs no plotting library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from tritune.aot.stats import StatRow
from tritune.store.atomic import atomic_write_text

_ROW_H = 22
_BAR_H = 14
_CHAR_W = 7.2  # monospace 12px: wide enough to size the label column from the longest id
_FONT = 'font-family="monospace" font-size="12"'
_BAR, _FASTEST, _WHISKER = "#7aa6d6", "#2e8b57", "#333333"


def write_time_plot(path: Path, rows: Sequence[StatRow], title: str) -> Path:
    """Write the SVG of `rows` to `path` atomically; returns the path."""
    atomic_write_text(Path(path), time_plot_svg(rows, title))
    return Path(path)


def time_plot_svg(rows: Sequence[StatRow], title: str) -> str:
    """The SVG text. A row counts as valid only with a finite median > 0; the others go to the list below."""
    good = sorted((r for r in rows if r.valid and math.isfinite(r.median_us) and r.median_us > 0),
                  key=lambda r: r.median_us)
    plotted = {id(r) for r in good}
    bad = [r for r in rows if id(r) not in plotted]
    label_w = max([len(r.artifact) for r in good] + [12]) * _CHAR_W + 16
    value_w = 150
    chart_w = 520
    width = int(label_w + chart_w + value_w)
    top = 44
    scale_max = _nice_ceiling(max([_hi(r) for r in good], default=1.0))
    x0 = label_w

    def x(us: float) -> float:
        return x0 + chart_w * min(us, scale_max) / scale_max

    out = [f'<text x="10" y="22" font-family="monospace" font-size="14" font-weight="bold">{_text(title)}</text>']
    y = top
    if not good:
        out.append(f'<text x="10" y="{y + 14}" {_FONT}>no valid configuration</text>')
        y += _ROW_H
    for i, row in enumerate(good):
        mid = y + _ROW_H / 2
        colour = _FASTEST if i == 0 else _BAR
        out.append(f'<text x="{x0 - 8:.1f}" y="{mid + 4:.1f}" {_FONT} text-anchor="end">{_text(row.artifact)}</text>')
        out.append(f'<rect x="{x0:.1f}" y="{mid - _BAR_H / 2:.1f}" width="{x(row.median_us) - x0:.1f}" '
                   f'height="{_BAR_H}" fill="{colour}"><title>{_text(_tooltip(row))}</title></rect>')
        if math.isfinite(row.min_us) and math.isfinite(row.max_us):
            lo, hi = x(row.min_us), x(row.max_us)
            out.append(f'<line x1="{lo:.1f}" y1="{mid:.1f}" x2="{hi:.1f}" y2="{mid:.1f}" stroke="{_WHISKER}"/>')
            for edge in (lo, hi):
                out.append(f'<line x1="{edge:.1f}" y1="{mid - 4:.1f}" x2="{edge:.1f}" y2="{mid + 4:.1f}" '
                           f'stroke="{_WHISKER}"/>')
        note = " fastest" if i == 0 else ""
        weight = ' font-weight="bold"' if i == 0 else ""
        out.append(f'<text x="{x0 + chart_w + 8:.1f}" y="{mid + 4:.1f}" {_FONT}{weight}>'
                   f'{row.median_us:.2f} us{note}</text>')
        y += _ROW_H
    if good:
        out.extend(_axis(x0, chart_w, y, scale_max))
        y += 36
    if bad:
        out.append(f'<text x="10" y="{y + 14}" {_FONT} font-weight="bold">not valid ({len(bad)}):</text>')
        y += _ROW_H
        for row in bad:
            out.append(f'<text x="10" y="{y + 14}" {_FONT}>{_text(f"{row.artifact}: {row.reason}")}</text>')
            y += _ROW_H
    # Invalid lines can be longer than the chart; widen rather than clip them.
    longest = max([len(f"{r.artifact}: {r.reason}") * _CHAR_W + 20 for r in bad] + [width])
    width = int(max(width, min(longest, 4000)))
    height = y + 12
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">')
    return "\n".join(['<?xml version="1.0" encoding="UTF-8"?>', head,
                      f'<rect width="{width}" height="{height}" fill="white"/>', *out, "</svg>", ""])


def _axis(x0: float, chart_w: float, y: float, scale_max: float) -> list[str]:
    """A baseline with 5 ticks labelled in microseconds."""
    out = [f'<line x1="{x0:.1f}" y1="{y + 2}" x2="{x0 + chart_w:.1f}" y2="{y + 2}" stroke="#999"/>']
    for k in range(6):
        us = scale_max * k / 5
        tx = x0 + chart_w * k / 5
        out.append(f'<line x1="{tx:.1f}" y1="{y + 2}" x2="{tx:.1f}" y2="{y + 6}" stroke="#999"/>')
        out.append(f'<text x="{tx:.1f}" y="{y + 18}" {_FONT} text-anchor="middle">{us:g}</text>')
    out.append(f'<text x="{x0 + chart_w:.1f}" y="{y + 32}" {_FONT} text-anchor="end">median time (us), '
               f'whiskers min-max</text>')
    return out


def _hi(row: StatRow) -> float:
    return row.max_us if math.isfinite(row.max_us) else row.median_us


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= value, so tick labels stay short."""
    if not math.isfinite(value) or value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 2.5, 5, 10) if step * power >= value * (1 - 1e-12))


def _tooltip(row: StatRow) -> str:
    params = ", ".join(f"{k}={v}" for k, v in row.params.items())
    return f"{row.artifact}: median {row.median_us:.3f} us, min {row.min_us:.3f}, max {row.max_us:.3f}; {params}"


def _text(value: str) -> str:
    """XML-escaped text; characters XML 1.0 forbids (most control codes) become '?'."""
    clean = "".join(c if c in "\t\n\r" or ord(c) >= 0x20 else "?" for c in value)
    clean = "".join("?" if 0xD800 <= ord(c) <= 0xDFFF or ord(c) in (0xFFFE, 0xFFFF) else c for c in clean)
    return clean.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
