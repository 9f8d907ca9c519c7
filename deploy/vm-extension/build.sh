#!/usr/bin/env bash
# Build the sefwd Azure VM extension package (a zip with HandlerManifest.json at its root).
#
#   deploy/vm-extension/build.sh [--out DIR] [--no-wheel]
#
# The zip holds: HandlerManifest.json, handler.py, README.md, linux/ (a copy of deploy/linux:
# install.sh, uninstall.sh, the systemd unit) and wheels/ (this project built with
# `pip wheel --no-deps .`). The wheel's dependencies are NOT bundled: install.sh fetches them
# from PyPI (or the pip index configured on the VM) at install time.
# --no-wheel leaves wheels/ out (fast; for tests of the layout: such a zip cannot install).
# Needs python3 (>= 3.11 to read pyproject.toml) with pip; prints the zip's path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$repo/dist"
wheel=1
python="${PYTHON:-python3}"

while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --no-wheel) wheel=0; shift ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
done

if [ ! -f "$repo/deploy/linux/install.sh" ] || [ ! -f "$repo/deploy/linux/uninstall.sh" ]; then
    echo "build.sh: deploy/linux/install.sh and uninstall.sh are required (the extension runs them)" >&2
    exit 1
fi

version="$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$repo/pyproject.toml")"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

cp "$here/HandlerManifest.json" "$here/handler.sh" "$here/handler.py" "$here/README.md" "$stage/"
chmod 0755 "$stage/handler.sh" "$stage/handler.py"
mkdir -p "$stage/linux"
(cd "$repo/deploy/linux" && tar --exclude=__pycache__ -cf - .) | (cd "$stage/linux" && tar -xf -)
find "$stage/linux" -name '*.sh' -exec chmod 0755 {} +

if [ "$wheel" = 1 ]; then
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$stage/wheels" "$repo" >&2
fi

mkdir -p "$out"
zip_path="$out/sefwd-vm-extension-$version.zip"
rm -f "$zip_path"
# zipfile keeps the Unix modes (handler.py must stay executable: waagent runs it by path).
"$python" - "$stage" "$zip_path" <<'PY'
import os, sys, zipfile
stage, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
    for root, dirs, files in os.walk(stage):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            zf.write(path, os.path.relpath(path, stage))
PY
echo "$zip_path"
