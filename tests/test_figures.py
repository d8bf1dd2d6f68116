"""linearize.figures.save_png: a palette PNG that keeps the figure's line colours, the same bytes each time."""

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from PIL import Image

from linearize.figures import PALETTE_COLOURS, save_png


def lines_figure() -> Figure:
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    for i in range(10):
        ax.plot([0, 1], [i, i + 1], color=f"C{i}", linewidth=4, label=f"row {i}")
    ax.legend(fontsize=6)
    return fig


def test_a_palette_png_that_keeps_every_line_colour(tmp_path):
    path = save_png(lines_figure(), tmp_path / "lines.png", dpi=80)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.mode == "P" and image.size == (320, 240)
        palette = image.getpalette()[: 3 * PALETTE_COLOURS]
    entries = [tuple(palette[i:i + 3]) for i in range(0, len(palette), 3)]
    for i in range(10):
        colour = tuple(round(255 * c) for c in to_rgb(f"C{i}"))
        nearest = min(sum((a - b) ** 2 for a, b in zip(colour, entry)) ** 0.5 for entry in entries)
        assert nearest < 12, (f"C{i}", colour, nearest)


def test_the_same_figure_gives_the_same_bytes_and_fewer_than_rgba(tmp_path):
    first = save_png(lines_figure(), tmp_path / "a.png", dpi=80).read_bytes()
    assert save_png(lines_figure(), tmp_path / "b.png", dpi=80).read_bytes() == first
    lines_figure().savefig(tmp_path / "rgba.png", dpi=80)
    assert len(first) < (tmp_path / "rgba.png").stat().st_size
