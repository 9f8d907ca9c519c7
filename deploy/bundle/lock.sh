#!/usr/bin/env bash
# Refresh the lock files the offline bundle is built from: deploy/bundle/lock/core.txt (the agent's
# own dependencies) and one per extra (lock/<extra>.txt: core plus that extra), every pin with the
# sha256 of every file PyPI has for it, resolved once for every Python 3.10-3.13 and platform
# (markers such as python_version < '3.11' kept).
#
#   deploy/bundle/lock.sh            needs uv (pip install uv; UV=... to name it)
#
# Commit the result: build.sh only ever downloads what these files pin, and checks the hashes.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
uv="${UV:-uv}"
command -v "$uv" >/dev/null 2>&1 || { echo "lock.sh: uv not found (pip install uv, or UV=/path/to/uv)" >&2; exit 1; }
extras="$(sed -n '/^\[project.optional-dependencies\]/,/^\[/p' "$repo/pyproject.toml" \
    | sed -n 's/^\([a-z][a-z0-9_-]*\) = .*/\1/p' | grep -vx -e all -e test -e bench -e consumers)"  # consumers: the Function apps, not the VM
mkdir -p "$here/lock"
compile() {  # OUTPUT [--extra NAME]
    local out="$1"; shift
    (cd "$repo" && "$uv" pip compile pyproject.toml "$@" --universal --python-version 3.10 --generate-hashes \
        --no-header --quiet --custom-compile-command "deploy/bundle/lock.sh" -o "$here/lock/$out")
}
compile core.txt
for extra in $extras; do
    # core.txt's pins constrain every extra, so the files agree where they overlap
    compile "$extra.txt" --extra "$extra" -c "$here/lock/core.txt"
done
ls "$here/lock"
