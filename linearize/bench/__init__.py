"""Speed and memory measurements: `linearize bench kernels|model|train|serve`; `report` merges their
tables into the docs.

Each benchmark writes DIR/<name>.json (every number, the device, versions, settings and the exact command),
DIR/<name>.md (tables) and PNG plots; `python -m linearize.bench.report DIR...` puts the tables into
docs/benchmarks.md (or, with `--doc docs/serving.md`, the serving figures).
"""
