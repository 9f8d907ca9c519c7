#!/usr/bin/env bash
# Build the offline bundle: this project's wheel plus every dependency it needs as wheels, for
# CPython 3.10-3.13 on Linux x86_64 and aarch64, so a VM installs it with no package index.
#
#   deploy/bundle/build.sh OUT [--extras LIST] [--pythons "3.10 3.13"] [--archs "x86_64"]
#
# OUT gets sefwd-bundle-VERSION.tar.gz and its .sha256. Inside, sefwd-bundle-VERSION/ holds
#   wheelhouse/  the project's wheel (a version unique to the build) and the dependencies' wheels
#   linux/       deploy/linux (install.sh installs from ../wheelhouse with pip --no-index)
#   lock/        the lock files the wheels were pinned and hash-checked by
#   BUNDLE.txt   version, extras, interpreters, platforms;  SHA256SUMS  every file's sha256
# --extras: comma-separated extras (sink SDKs), "all" for every one; default none (the stdout,
#   file and webhook sinks need no extra). Only binary wheels (manylinux_2_28 or older: RHEL 8's
#   glibc) are taken; the pins and their sha256 come from deploy/bundle/lock/ (lock.sh refreshes).
# Needs python3 (PYTHON=...) with pip, and a package index (or pip's cache) on the build machine.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
extras=""
pythons="3.10 3.11 3.12 3.13"
archs="x86_64 aarch64"
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --extras) extras="$2"; shift 2 ;;
        --extras=*) extras="${1#*=}"; shift ;;
        --pythons) pythons="$2"; shift 2 ;;
        --pythons=*) pythons="${1#*=}"; shift ;;
        --archs) archs="$2"; shift 2 ;;
        --archs=*) archs="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage >&2; echo "build.sh: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$out" ] || { usage >&2; exit 2; }; out="$1"; shift ;;
    esac
done
[ -n "$out" ] || { usage >&2; exit 2; }

locks=("$here/lock/core.txt")
if [ "$extras" = all ]; then
    extras="$(cd "$here/lock" && ls -- *.txt | sed 's/\.txt$//' | grep -vx core | paste -sd, -)"
fi
for extra in ${extras//,/ }; do
    [ -f "$here/lock/$extra.txt" ] || { echo "build.sh: no lock file for the extra '$extra' (deploy/bundle/lock/$extra.txt)" >&2; exit 2; }
    locks+=("$here/lock/$extra.txt")
done
for py in $pythons; do
    case "$py" in 3.10|3.11|3.12|3.13) ;; *) echo "build.sh: --pythons: 3.10 to 3.13, got '$py'" >&2; exit 2 ;; esac
done
for arch in $archs; do
    case "$arch" in x86_64|aarch64) ;; *) echo "build.sh: --archs: x86_64 or aarch64, got '$arch'" >&2; exit 2 ;; esac
done

stage="$(mktemp -d "${TMPDIR:-/tmp}/sefwd-bundle.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/b/wheelhouse" "$stage/b/lock" "$stage/b/linux"
wheel="$(bash "$here/project-wheel.sh" "$stage/b/wheelhouse")"
version="$(basename "$wheel" | sed 's/^scheduled_events_forwarder-\([^-]*\)-.*/\1/')"

for py in $pythons; do
    for arch in $archs; do
        "$python" "$here/select_lock.py" "$py" "$arch" "${locks[@]}" >"$stage/req-$py-$arch.txt"
        echo "build.sh: wheels for CPython $py on $arch" >&2
        # --no-deps: the lock is complete (every transitive pin), and pip would evaluate markers for
        # the Python running it rather than the target; --require-hashes: each file must match the lock.
        "$python" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
            --only-binary=:all: --implementation cp --python-version "$py" \
            --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch" \
            --dest "$stage/b/wheelhouse" -r "$stage/req-$py-$arch.txt" >&2
    done
done

cp "${locks[@]}" "$stage/b/lock/"
(cd "$repo/deploy/linux" && tar --exclude=__pycache__ -cf - .) | (cd "$stage/b/linux" && tar -xf -)
chmod 0755 "$stage/b/linux/"*.sh
cat >"$stage/b/BUNDLE.txt" <<EOF
name: scheduled-events-forwarder offline bundle
version: $version
extras: ${extras:-none}
pythons: $pythons
platforms: $(for a in $archs; do printf 'manylinux_2_28_%s ' "$a"; done)
built: $(date -u +%Y-%m-%dT%H:%M:%SZ)
install: sudo linux/install.sh --extras '${extras}'   (pip --no-index from wheelhouse/)
EOF
(cd "$stage/b" && find . -type f ! -name SHA256SUMS | sed 's#^\./##' | LC_ALL=C sort | xargs sha256sum >SHA256SUMS)

name="sefwd-bundle-$version"
mv "$stage/b" "$stage/$name"
mkdir -p "$out"
archive="$(cd "$out" && pwd)/$name.tar.gz"
tar -C "$stage" -czf "$archive" "$name"
(cd "$(dirname "$archive")" && sha256sum "$name.tar.gz" >"$name.tar.gz.sha256")
echo "build.sh: $(du -k "$archive" | cut -f1) KiB, $(ls "$stage/$name/wheelhouse" | wc -l) wheels (extras: ${extras:-none}; CPython $pythons; $archs)" >&2
echo "$archive"
