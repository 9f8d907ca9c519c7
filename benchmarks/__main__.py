"""`python -m benchmarks [--quick] [--only NAME]`: run the benchmarks, print a table, write results JSON."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from benchmarks.common import MODES, RESULTS, machine_info

BENCHMARKS = ("poll_cost", "journal", "backlog", "footprint")


def _flat(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{prefix}.{k}" if prefix else k, v)]
    return [(prefix, value)]


def _table(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results.items():
        lines.append(f"== {name} ({res['seconds']} s) {'PASS' if res['pass'] else 'FAIL'}")
        lines += [f"  {k:<45} {v}" for k, v in _flat("", res["figures"])]
        lines += [f"  [{'pass' if g['pass'] else 'FAIL'}] {g['goal']}" for g in res["goals"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes: the whole run takes under 3 minutes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, only checks that everything runs")
    parser.add_argument("--only", action="append", choices=BENCHMARKS, metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json", help="results file (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)  # expected warnings (fresh cursors, http) are noise here

    sizes = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    results: dict[str, Any] = {}
    for name in args.only or BENCHMARKS:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        results[name] = importlib.import_module(f"benchmarks.{name}").run(sizes)
        results[name]["seconds"] = round(time.monotonic() - start, 1)
    doc = {"machine": machine_info(), "mode": "quick" if args.quick or args.smoke else "full", "smoke": args.smoke, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print(_table(results))
    print(f"results written to {args.out}")
    return 0 if all(r["pass"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
