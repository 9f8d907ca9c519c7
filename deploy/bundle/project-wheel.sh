#!/usr/bin/env bash
# Build this project's wheel, versioned per build, from a clean copy of the checkout.
#
#   deploy/bundle/project-wheel.sh OUTDIR      prints the wheel's path
#
# The copy holds the files git knows (tracked and not ignored, as they are in the work tree), so
# a stale build/ directory or a module deleted since the last build never reaches the wheel;
# outside a git checkout it is a copy without build/, dist/, *.egg-info and caches.
# The version gets a local segment unique to the build: 0.1.0+20261127165200.g5184fdf (UTC time,
# commit, ".dirty" for uncommitted changes); SEFWD_BUILD_LOCAL=TEXT sets the segment instead (the
# extension's version, e.g. "ext1.2.0"). pip then sees every build as a new version.
# Needs python3 (PYTHON=...) with pip; the build backend (setuptools) comes from the index or pip's cache.
set -euo pipefail

[ $# -eq 1 ] || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$1"
out="$(cd "$1" && pwd)"
copy="$(mktemp -d "${TMPDIR:-/tmp}/sefwd-wheel.XXXXXX")"
trap 'rm -rf "$copy"' EXIT

local_part="${SEFWD_BUILD_LOCAL:-}"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # Tracked and untracked-but-not-ignored files that exist (a deleted tracked file is listed too).
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | (cd "$copy" && tar -xf -)
    if [ -z "$local_part" ]; then
        local_part="$(date -u +%Y%m%d%H%M%S).g$(git -C "$repo" rev-parse --short=10 HEAD)"
        [ -z "$(git -C "$repo" status --porcelain --untracked-files=no)" ] || local_part="$local_part.dirty"
    fi
else
    (cd "$repo" && tar --exclude=.git --exclude=.venv --exclude=venv --exclude=node_modules --exclude=__pycache__ \
        --exclude='*.egg-info' --exclude=./build --exclude=./dist --exclude=.pytest_cache --exclude=.mypy_cache \
        --exclude=.hypothesis -cf - .) | (cd "$copy" && tar -xf -)
    [ -n "$local_part" ] || local_part="$(date -u +%Y%m%d%H%M%S)"
fi
case "$local_part" in *[!A-Za-z0-9.]*|.*|*.) echo "project-wheel.sh: SEFWD_BUILD_LOCAL: letters, digits and inner dots only, got '$local_part'" >&2; exit 2 ;; esac

base="$(sed -n 's/^version = "\([^"+]*\)".*/\1/p' "$copy/pyproject.toml" | head -n 1)"
[ -n "$base" ] || { echo "project-wheel.sh: no version = \"...\" in pyproject.toml" >&2; exit 1; }
version="$base+$local_part"
sed -i "s/^version = \"[^\"]*\"/version = \"$version\"/" "$copy/pyproject.toml"
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$copy/dist" "$copy" >&2
wheel="$(ls "$copy"/dist/*.whl)"
cp "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
