"""Draw the plots of saved results again from their JSON, with the package's current figure saver.

    python experiments/scripts/redraw_bench_plots.py docs/results

Each argument is searched for `<bench>.json` files (kernels, model, serve, train) and for still_routing.py's
`routing.json` and `mass.json`; each one's PNGs are drawn beside it by the function the run itself called
(the bench's `plots`, still_routing.py's `plot` and `mass_plot`). The figures are the same; only their
encoding follows `linearize.figures` (palette PNGs, a third of the size).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import still_routing  # a sibling script, not a package: found through the path above

BENCHES = ("kernels", "model", "serve", "train")


def main(paths: list[str]) -> int:
    for root in map(Path, paths):
        for name in BENCHES:
            for found in sorted(root.rglob(f"{name}.json")):
                results = json.loads(found.read_text(encoding="utf-8"))
                if results.get("bench") != name:
                    continue
                drawn = importlib.import_module(f"linearize.bench.{name}").plots(results, found.parent)
                print(found.parent, [p.name for p in drawn])
        for name, draw in (("routing", still_routing.plot), ("mass", still_routing.mass_plot)):
            for found in sorted(root.rglob(f"{name}.json")):
                draw(json.loads(found.read_text(encoding="utf-8")), found.with_suffix(".png"))
                print(found.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
