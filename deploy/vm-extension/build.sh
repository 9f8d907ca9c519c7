#!/usr/bin/env bash
# Build the sefwd Azure VM extension package (a zip with HandlerManifest.json at its root).
#
#   deploy/vm-extension/build.sh [--out DIR] [--no-wheel] [--offline [--pythons "3.10 ..."] [--archs "x86_64 ..."]]
#
# The zip holds: HandlerManifest.json, handler.sh (finds a Python >= 3.10, then runs handler.py),
# handler.py, README.md, linux/ (a copy of deploy/linux: install.sh, uninstall.sh, the systemd
# unit) and wheels/ (this project's wheel, built from a clean copy with a version unique to the
# build: deploy/bundle/project-wheel.sh). Without --offline the wheel's dependencies are NOT
# bundled: install.sh fetches them from PyPI (or the pip index configured on the VM).
# --offline adds wheelhouse/: the offline bundle's wheels (deploy/bundle/build.sh --extras all,
# for CPython 3.10-3.13 on x86_64 and aarch64 unless --pythons/--archs narrow it); install.sh
# then installs with pip --no-index, and the VM needs no package index.
# --no-wheel leaves wheels/ out (fast; for tests of the layout: such a zip cannot install).
# Needs python3 with pip; prints the zip's path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$repo/dist"
wheel=1
offline=0
bundle_args=()
python="${PYTHON:-python3}"

while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --no-wheel) wheel=0; shift ;;
        --offline) offline=1; shift ;;
        --pythons|--archs) bundle_args+=("$1" "$2"); shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
done

if [ ! -f "$repo/deploy/linux/install.sh" ] || [ ! -f "$repo/deploy/linux/uninstall.sh" ]; then
    echo "build.sh: deploy/linux/install.sh and uninstall.sh are required (the extension runs them)" >&2
    exit 1
fi

[ "$offline" = 0 ] || [ "$wheel" = 1 ] || { echo "build.sh: --offline needs the wheel (no --no-wheel)" >&2; exit 2; }
version="$(sed -n 's/^version = "\([^"]*\)".*/\1/p' "$repo/pyproject.toml" | head -n 1)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

cp "$here/HandlerManifest.json" "$here/handler.sh" "$here/handler.py" "$here/README.md" "$stage/"
chmod 0755 "$stage/handler.sh" "$stage/handler.py"
mkdir -p "$stage/linux"
(cd "$repo/deploy/linux" && tar --exclude=__pycache__ -cf - .) | (cd "$stage/linux" && tar -xf -)
find "$stage/linux" -name '*.sh' -exec chmod 0755 {} +

if [ "$offline" = 1 ]; then
    # The bundle's wheelhouse, and its project wheel (the same file) in wheels/ for the handler.
    archive="$(PYTHON="$python" bash "$repo/deploy/bundle/build.sh" "$stage/bundle" --extras all ${bundle_args[@]+"${bundle_args[@]}"})"
    tar -C "$stage/bundle" -xzf "$archive"
    mv "$stage/bundle"/sefwd-bundle-*/wheelhouse "$stage/wheelhouse"
    rm -rf "$stage/bundle"
    mkdir "$stage/wheels"
    cp "$stage"/wheelhouse/scheduled_events_forwarder-*.whl "$stage/wheels/"
elif [ "$wheel" = 1 ]; then
    PYTHON="$python" bash "$repo/deploy/bundle/project-wheel.sh" "$stage/wheels" >/dev/null
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
