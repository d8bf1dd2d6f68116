"""Figures saved as small PNGs: a palette of a few dozen colours instead of 32-bit pixels.

A results figure is lines, flat heatmap cells and text on white: its colours fit a 128-colour palette
with no visible change (an octree palette keeps each of matplotlib's ten line colours within a few
levels of itself), and the file comes out about a third of the size, which keeps the figures
committed under docs/results small. The same figure gives the same bytes (no timestamp is written).
"""

from __future__ import annotations

import io
from pathlib import Path

PALETTE_COLOURS = 128


def save_png(fig, path: str | Path, *, dpi: int, **savefig_kwargs) -> Path:
    """Render the matplotlib figure `fig` at `dpi` and write it to `path` as a palette PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, **savefig_kwargs)
    buffer.seek(0)
    with Image.open(buffer) as image:
        # Without dithering, flat areas stay flat. An octree palette keeps small line colours that a
        # median cut merges (orange into red) where white and grey fill most of the figure.
        paletted = image.convert("RGB").quantize(colors=PALETTE_COLOURS, method=Image.Quantize.FASTOCTREE,
                                                 dither=Image.Dither.NONE)
    paletted.save(path, format="PNG", optimize=True)
    return Path(path)
