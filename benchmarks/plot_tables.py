"""Render the tables of docs/benchmarks.md as PNGs under docs/img/ (matplotlib; ``pip install matplotlib``).

A table is plotted when the line just before it is a marker ``<!-- plot: NAME KIND -->``:

* ``lines``: one line per row against the header's M columns (``M = 1 | 4 | ...``), both axes logarithmic; the
  header's first cell is the title (and names the unit).
* ``bars``: one bar per row for the second column, and for every other column whose header ends in the same
  unit (e.g. ``tok/s``), grouped; each bar labelled with its cell.

    python benchmarks/plot_tables.py                      # docs/benchmarks.md -> docs/img/*.png
    python benchmarks/plot_tables.py --doc X.md --out DIR
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*plot:\s*(\S+)\s+(lines|bars)\s*-->")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def cells(line: str) -> list[str]:
    return [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]


def number(text: str) -> float | None:
    found = NUMBER.search(text.replace(",", ""))
    return float(found.group()) if found else None


def tables(doc: str) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """(name, kind, header cells, body rows) of every marked table in ``doc``."""
    out, lines = [], doc.splitlines()
    for i, line in enumerate(lines):
        mark = MARKER.fullmatch(line.strip())
        if not mark:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        rows = []
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            rows.append(cells(lines[j]))
            j += 1
        if len(rows) < 3:
            raise SystemExit(f"plot marker {mark.group(1)!r}: no markdown table right after it")
        out.append((mark.group(1), mark.group(2), rows[0], rows[2:]))
    return out


def plot_lines(plt, header, body):
    xs = [number(h) for h in header[1:]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for row in body:
        pts = [(x, number(v)) for x, v in zip(xs, row[1:]) if x is not None and number(v) is not None]
        style = dict(linestyle="--", color="0.5") if row[0].startswith("floor") else dict(marker="o", markersize=4)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=row[0], **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([x for x in xs if x is not None], [str(int(x)) for x in xs if x is not None])
    ax.set_xlabel("M (rows of x)")
    ax.set_ylabel("µs per call (lower is better)")
    ax.set_title(re.sub(r",\s*µs$", "", header[0]), fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_bars(plt, header, body):
    unit = header[1].split()[-1]
    cols = [i for i, h in enumerate(header) if i and h.split() and h.split()[-1] == unit]
    labels = [row[0] for row in body]
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(body) * len(cols) + 1.8))
    height = 0.8 / len(cols)
    top = 0.0
    for j, c in enumerate(cols):
        values = [number(row[c]) or 0.0 for row in body]
        top = max(top, *values)
        pos = [i + (j - (len(cols) - 1) / 2) * height for i in range(len(body))]
        color = ["0.6"] + ["C0"] * (len(body) - 1) if len(cols) == 1 else f"C{j}"
        bars = ax.barh(pos, values, height=height * 0.9, color=color, label=header[c])
        ax.bar_label(bars, [row[c] for row in body], padding=3, fontsize=8)
    ax.set_yticks(range(len(body)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} (higher is better)")
    ax.set_xlim(0, top * 1.15)
    ax.grid(True, axis="x", alpha=0.3)
    if len(cols) > 1:
        ax.legend(fontsize=8, loc="lower right")
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_tables needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, kind, header, body in tables(Path(args.doc).read_text()):
        fig = (plot_lines if kind == "lines" else plot_bars)(plt, header, body)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90, metadata={"Software": None})
        plt.close(fig)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
