"""``python -m fastattn info | bench``: what this install is, and how fast it runs here."""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

from . import __version__, _bench, backends


def _info() -> int:
    print(f"fastattn {__version__} on Python {platform.python_version()}, numpy {np.__version__}")
    print(f"machine: {platform.machine()} {platform.system()}")
    print("backends:")
    for name, status in backends.available().items():
        print(f"  {name:<10} {status!r}")
    return 0


def _bench_command(quick: bool, json_path: str | None) -> int:
    cases = _bench.QUICK_CASES if quick else _bench.FULL_CASES
    rows = _bench.run_cases(cases, repeats=3 if quick else 7, progress=lambda line: print(f"  timing {line}", file=sys.stderr))
    print(_bench.format_table(rows))
    if json_path:
        _bench.write_json(rows, json_path, cases)
        print(f"wrote {json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastattn``."""
    parser = argparse.ArgumentParser(prog="python -m fastattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, build and backends with why each is (un)available")
    bench = commands.add_parser("bench", help="time every available backend against numpy attention")
    bench.add_argument("--quick", action="store_true", help="small cases, fewer repeats (under a minute)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    arguments = parser.parse_args(argv)
    if arguments.command == "info":
        return _info()
    return _bench_command(arguments.quick, arguments.json)


if __name__ == "__main__":
    sys.exit(main())
