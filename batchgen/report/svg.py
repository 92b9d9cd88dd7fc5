"""Tiny inline-SVG charts (lines and box plots): the HTML report must work offline, with no JS libraries."""

from __future__ import annotations

import html
import math

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
W, H, ML, MR, MT, MB = 680, 300, 64, 16, 28, 44


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.3g}"
    return f"{v:.2g}"


class _Frame:
    def __init__(self, xs, ys, y_from_zero=True):
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0, 1)
        self.y0, self.y1 = (min(ys), max(ys)) if ys else (0, 1)
        if y_from_zero:
            self.y0 = min(0.0, self.y0)
        if self.x1 == self.x0:
            self.x1 = self.x0 + 1
        if self.y1 == self.y0:
            self.y1 = self.y0 + 1
        self.y1 += (self.y1 - self.y0) * 0.05

    def px(self, x):
        return ML + (x - self.x0) / (self.x1 - self.x0) * (W - ML - MR)

    def py(self, y):
        return H - MB - (y - self.y0) / (self.y1 - self.y0) * (H - MT - MB)

    def axes(self, title, xlabel, ylabel) -> list[str]:
        out = [f'<text x="{W / 2}" y="16" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
               f'<line x1="{ML}" y1="{H - MB}" x2="{W - MR}" y2="{H - MB}" stroke="#444"/>',
               f'<line x1="{ML}" y1="{MT}" x2="{ML}" y2="{H - MB}" stroke="#444"/>',
               f'<text x="{(ML + W - MR) / 2}" y="{H - 8}" text-anchor="middle">{html.escape(xlabel)}</text>',
               f'<text x="14" y="{(MT + H - MB) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(MT + H - MB) / 2})">{html.escape(ylabel)}</text>']
        for t in _ticks(self.x0, self.x1):
            out.append(f'<text x="{self.px(t):.1f}" y="{H - MB + 16}" text-anchor="middle">{_fmt(t)}</text>')
        for t in _ticks(self.y0, self.y1):
            y = self.py(t)
            out.append(f'<line x1="{ML}" y1="{y:.1f}" x2="{W - MR}" y2="{y:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        return out


def _svg(parts: list[str], legend: list[str]) -> str:
    items = [f'<tspan fill="{PALETTE[i % len(PALETTE)]}">&#9632; {html.escape(name)}</tspan> '
             for i, name in enumerate(legend)]
    leg = f'<text x="{ML + 8}" y="{MT + 12}" font-size="11">{"".join(items)}</text>' if len(legend) > 1 else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
            f'font-family="sans-serif" font-size="11">{"".join(parts)}{leg}</svg>')


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
               markers: bool = False, y_from_zero: bool = True) -> str:
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts if y is not None]
    f = _Frame(xs, ys, y_from_zero)
    parts = f.axes(title, xlabel, ylabel)
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = [(x, y) for x, y in pts if y is not None]
        path = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>')
        if markers:
            parts += [f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="2.5" fill="{color}"/>' for x, y in pts]
    return _svg(parts, list(series))


def box_chart(groups: dict[str, list[tuple[str, float, float, float, float, float]]], title: str, xlabel: str,
              ylabel: str) -> str:
    """groups: series name -> [(category, p5, p25, p50, p75, p95)]; whiskers p5..p95, box p25..p75."""
    cats = list(dict.fromkeys(c for rows in groups.values() for c, *_ in rows))
    ys = [v for rows in groups.values() for r in rows for v in r[1:]]
    f = _Frame([0, len(cats)], ys)
    parts = f.axes(title, xlabel, ylabel)[:5]  # no numeric x ticks: categories instead
    for t in _ticks(f.y0, f.y1):
        y = f.py(t)
        parts.append(f'<line x1="{ML}" y1="{y:.1f}" x2="{W - MR}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    slot = (W - ML - MR) / max(len(cats), 1)
    width = slot * 0.7 / max(len(groups), 1)
    for ci, c in enumerate(cats):
        parts.append(f'<text x="{ML + slot * (ci + 0.5):.1f}" y="{H - MB + 16}" text-anchor="middle">'
                     f'{html.escape(c)}</text>')
    for gi, (name, rows) in enumerate(groups.items()):
        color = PALETTE[gi % len(PALETTE)]
        for c, p5, p25, p50, p75, p95 in rows:
            x = ML + slot * cats.index(c) + slot * 0.15 + gi * width
            mid = x + width / 2
            parts += [
                f'<line x1="{mid:.1f}" y1="{f.py(p5):.1f}" x2="{mid:.1f}" y2="{f.py(p95):.1f}" stroke="{color}"/>',
                f'<rect x="{x:.1f}" y="{f.py(p75):.1f}" width="{width:.1f}" '
                f'height="{max(f.py(p25) - f.py(p75), 1):.1f}" fill="{color}" fill-opacity="0.35" stroke="{color}"/>',
                f'<line x1="{x:.1f}" y1="{f.py(p50):.1f}" x2="{x + width:.1f}" y2="{f.py(p50):.1f}" '
                f'stroke="{color}" stroke-width="2"/>']
    return _svg(parts, list(groups))
