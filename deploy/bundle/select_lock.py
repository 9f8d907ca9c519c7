"""Print the pins of lock files that apply to one CPython version on Linux/ARCH, markers evaluated, hashes kept.

    python3 select_lock.py 3.10 x86_64 lock/core.txt [lock/eventhubs.txt ...]

pip download --python-version picks wheels for that version but evaluates markers against the
Python running pip, so the bundle's build does the markers itself (tomli for 3.10 only, ...).
"""
from __future__ import annotations

import re
import sys

try:
    from packaging.markers import Marker
except ImportError:  # pip always carries it
    from pip._vendor.packaging.markers import Marker  # type: ignore[assignment]

_PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


def entries(text: str) -> list[tuple[str, str, str, list[str]]]:
    """(name, version, marker, hashes) of each pin in a `uv pip compile --generate-hashes` file."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(" --hash=")
        requirement, hashes = parts[0].strip(), [h.strip() for h in parts[1:]]
        spec, _, marker = requirement.partition(";")
        pin = _PIN.match(spec.strip())
        if not pin or not hashes:
            raise SystemExit(f"select_lock.py: not a hashed pin: {line[:120]}")
        found.append((pin.group(1).lower(), pin.group(2), marker.strip(), hashes))
    return found


def select(texts: list[str], python: str, machine: str) -> list[str]:
    """The lines `name==version --hash=...` that apply, one per package (the lock files agree where they overlap)."""
    env = {"python_version": python, "python_full_version": python + ".0", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "os_name": "posix", "platform_machine": machine}
    chosen: dict[str, str] = {}
    for text in texts:
        for name, version, marker, hashes in entries(text):
            if marker and not Marker(marker).evaluate(env):
                continue
            line = f"{name}=={version} " + " ".join(f"--hash={h}" for h in hashes)
            if chosen.get(name, line) != line:
                raise SystemExit(f"select_lock.py: the lock files pin {name} differently: run deploy/bundle/lock.sh")
            chosen[name] = line
    return [chosen[name] for name in sorted(chosen)]


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    python, machine, files = argv[0], argv[1], argv[2:]
    texts = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    print("\n".join(select(texts, python, machine)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
