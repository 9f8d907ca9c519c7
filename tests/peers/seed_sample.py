"""Microsoft's published Python sample (Scheduled Events for Windows VMs, api-version 2020-07-01).

The code is never copied or ported here: it is taken verbatim from the seed document
(``/work/shared/seeds/scheduled-events-windows-2020-07-01-current.txt``, the "Python Sample"
section) or, where the seeds are not at hand, from ``tests/fixtures/seed-python-sample.txt``
(the same bytes, checked against the seed by ``tests/integration/test_seed_sample.py``). Only the
URL literal is replaced.

The sample is already Python 3 (``input()``, ``requests``): nothing else needs to change. Its
``main()`` is interactive ("Press 1 to poll for new events, 2 to exit"), so the way to drive it
is its standard input: one "1" line per document to process, then "2".

As a program: ``python tests/peers/seed_sample.py URL [CALLS]`` runs the published code with
``URL`` as its metadata_url and "1" typed CALLS times (default 2), then "2".
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

SEED = Path(__file__).resolve().parents[3] / "shared" / "seeds" / "scheduled-events-windows-2020-07-01-current.txt"
VENDORED = Path(__file__).resolve().parents[1] / "fixtures" / "seed-python-sample.txt"
PUBLISHED_URL = "http://169.254.169.254/metadata/scheduledevents"


def extract(document: str) -> str:
    """The first "Python Sample" code of the seed document, verbatim (shebang to ``main()``)."""
    lines = document.splitlines(keepends=True)
    heading = next(i for i, line in enumerate(lines) if line.strip() == "Python Sample")
    first = next(i for i in range(heading, len(lines)) if lines[i].startswith("#!/usr/bin/python"))
    last = next(i for i in range(first + 1, len(lines))
                if lines[i].rstrip() == "    main()" and lines[i - 1].startswith("if __name__ == '__main__':"))
    return "".join(lines[first:last + 1])


def published() -> str:
    """The sample as published: from the seed when present, else the vendored copy of it."""
    if SEED.is_file():
        return extract(SEED.read_text(encoding="utf-8"))
    return VENDORED.read_text(encoding="utf-8")


def with_url(code: str, metadata_url: str) -> str:
    """The one change: the URL literal (it occurs exactly once)."""
    if code.count(f'"{PUBLISHED_URL}"') != 1:
        raise ValueError("the published sample no longer has exactly one metadata_url literal")
    return code.replace(f'"{PUBLISHED_URL}"', repr(metadata_url).replace("'", '"'))


def keystrokes(calls: int) -> str:
    """What a user types into the sample's prompt: poll ``calls`` times, then exit."""
    return "1\n" * calls + "2\n"


def main(argv: list[str]) -> None:
    url = argv[1] if len(argv) > 1 else PUBLISHED_URL
    calls = int(argv[2]) if len(argv) > 2 else 2
    code = with_url(published(), url)
    sys.stdin = io.StringIO(keystrokes(calls))
    exec(compile(code, "seed-python-sample", "exec"), {"__name__": "__main__"})  # noqa: S102 - the published sample


if __name__ == "__main__":
    main(sys.argv)
