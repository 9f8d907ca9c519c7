"""``python -m forwarder.emulator``: the same as ``sefwd emulator``, without the agent's CLI."""
from __future__ import annotations

import argparse
import sys

from forwarder.emulator.cli import register, run
from forwarder.errors import ConfigError, ForwarderError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forwarder.emulator")
    register(parser.add_subparsers(dest="command"), prog="python -m forwarder.emulator")
    args = parser.parse_args(["emulator", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ConfigError as exc:
        print(f"emulator: {exc}", file=sys.stderr)
        return 2
    except ForwarderError as exc:
        print(f"emulator: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
