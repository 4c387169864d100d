"""Draws docs/ring.svg: the ring of ranks and, for causal attention in the zigzag layout, which
rank computes which (query chunk, key chunk) block at which ring step. Plain SVG, no dependencies.

    python tools/draw_ring.py [--world-size 4] [--out docs/ring.svg]
"""
import argparse
import math
from pathlib import Path

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"]
FONT = 'font-family="Helvetica, Arial, sans-serif"'


def zigzag_chunks(rank, world_size):
    """The two chunks of 2*W that zigzag gives ``rank``."""
    return rank, 2 * world_size - 1 - rank


def owner(chunk, world_size):
    return chunk if chunk < world_size else 2 * world_size - 1 - chunk


def text(x, y, s, size=13, anchor="middle", weight="normal", colour="#222"):
    return (f'<text x="{x:.1f}" y="{y:.1f}" {FONT} font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{colour}">{s}</text>')


def ring_panel(world_size, cx, cy, radius):
    """Ranks on a circle, K/V blocks passed to the next rank at every step."""
    parts = [text(cx, cy - radius - 48, "K/V blocks travel round the ring", 15, weight="bold")]
    for r in range(world_size):
        a0 = -math.pi / 2 + 2 * math.pi * r / world_size
        a1 = -math.pi / 2 + 2 * math.pi * (r + 1) / world_size
        # arc arrow from rank r to rank r+1, kept clear of the nodes
        pad = 0.42
        x0, y0 = cx + radius * math.cos(a0 + pad), cy + radius * math.sin(a0 + pad)
        x1, y1 = cx + radius * math.cos(a1 - pad), cy + radius * math.sin(a1 - pad)
        parts.append(f'<path d="M {x0:.1f} {y0:.1f} A {radius} {radius} 0 0 1 {x1:.1f} {y1:.1f}" fill="none" '
                     f'stroke="#888" stroke-width="2" marker-end="url(#arrow)"/>')
        mid = (a0 + a1) / 2
        parts.append(text(cx + (radius + 20) * math.cos(mid), cy + (radius + 20) * math.sin(mid) + 4, "K,V", 11,
                          colour="#666"))
    for r in range(world_size):
        a = -math.pi / 2 + 2 * math.pi * r / world_size
        x, y = cx + radius * math.cos(a), cy + radius * math.sin(a)
        c0, c1 = zigzag_chunks(r, world_size)
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="34" fill="#fff" stroke="#333" stroke-width="2"/>')
        parts.append(text(x, y - 4, f"rank {r}", 13, weight="bold"))
        parts.append(text(x, y + 13, f"chunks {c0}, {c1}", 10, colour="#555"))
    parts.append(text(cx, cy - 6, "step s: rank r holds", 11, colour="#555"))
    parts.append(text(cx, cy + 10, "the K/V of rank r - s", 11, colour="#555"))
    return parts


def schedule_panel(world_size, x0, y0, cell):
    """Causal (query chunk x key chunk) blocks in global order, coloured by the step computing them."""
    n = 2 * world_size
    parts = [text(x0 + n * cell / 2, y0 - 48, "Causal blocks by ring step (zigzag)", 15, weight="bold")]
    for q in range(n):
        parts.append(text(x0 - 8, y0 + (q + 0.5) * cell + 4, f"q{q}", 10, anchor="end", colour="#555"))
        parts.append(text(x0 + (q + 0.5) * cell, y0 - 8, f"k{q}", 10, colour="#555"))
        for k in range(n):
            x, y = x0 + k * cell, y0 + q * cell
            if k > q:
                fill, opacity = "#fff", 1.0
            else:
                step = (owner(q, world_size) - owner(k, world_size)) % world_size
                fill, opacity = COLOURS[step % len(COLOURS)], 0.55 if k == q else 1.0
            parts.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="{fill}" '
                         f'fill-opacity="{opacity}" stroke="#ccc"/>')
            if k <= q:
                parts.append(text(x + cell / 2, y + cell / 2 + 4, f"r{owner(q, world_size)}", 10, colour="#fff"))
    ly = y0 + n * cell + 24
    for s in range(world_size):
        lx = x0 + s * (n * cell / world_size)
        parts.append(f'<rect x="{lx:.1f}" y="{ly}" width="14" height="14" fill="{COLOURS[s % len(COLOURS)]}"/>')
        parts.append(text(lx + 20, ly + 11, f"step {s}", 11, anchor="start"))
    parts.append(text(x0 + n * cell / 2, ly + 36, "rN: the rank that computes the block (it owns the query chunk);",
                      11, colour="#555"))
    parts.append(text(x0 + n * cell / 2, ly + 52, "pale: diagonal blocks, masked inside; white: skipped, transfer kept",
                      11, colour="#555"))
    return parts


def draw(world_size: int) -> str:
    cell = 34
    width, height = 380 + 2 * world_size * cell + 120, max(400, 2 * world_size * cell + 200)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#888"/></marker></defs>',
             f'<rect width="{width}" height="{height}" fill="#fff"/>']
    parts += ring_panel(world_size, 190, height / 2 + 10, 115)
    parts += schedule_panel(world_size, 420, 90, cell)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "ring.svg"))
    args = parser.parse_args()
    if not 2 <= args.world_size <= len(COLOURS):
        parser.error(f"--world-size must be between 2 and {len(COLOURS)}")
    Path(args.out).write_text(draw(args.world_size))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
