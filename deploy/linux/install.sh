#!/usr/bin/env bash
# Install sefwd as a hardened systemd service. Re-running upgrades in place; the config is never
# overwritten. See deploy/linux/README.md.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: install.sh [--source SRC | --source-file FILE] [--index-url-file FILE] [--extras LIST]
                  [--python PY] [--prefix DIR] [--no-user] [--no-start] [--index-fallback]

  --source SRC    what pip installs: a checkout of the project (a directory with pyproject.toml),
                  a wheel or sdist file, a URL (git+https://...@TAG, https://.../x.whl), or a
                  PyPI requirement (scheduled-events-forwarder==0.1.0).
                  Default: the bundle or checkout this script is in, else scheduled-events-forwarder.
                  In an offline bundle (deploy/bundle/build.sh: this script in linux/ beside
                  wheelhouse/) pip installs from wheelhouse/ alone (--no-index), after checking
                  the bundle's SHA256SUMS; the default source is the bundle's own wheel.
  --index-fallback  with a bundle: let pip also use the package index for what wheelhouse/ lacks.
  --source-file FILE  the source read from FILE (mode 0600), for a URL carrying a credential
                  (a SAS-signed wheel URL: ...whl?sv=...&sig=..., or https://user:token@host/x.whl):
                  `ps` shows every command line to every local user, so --source refuses those.
                  The wheel is downloaded by Python (the URL never on a command line) and pip
                  installs the local file.
  --index-url-file FILE  pip's index URL read from FILE (mode 0600), e.g.
                  https://build:TOKEN@pkgs.example.com/simple/ or https://TOKEN@host/simple/:
                  the user and token go to pip in a 0600 netrc file, the rest as PIP_INDEX_URL in
                  its environment, never as an argument. A URL with a query string (?token=...)
                  is refused: it would reach a command line. pip's output is redacted either way.
  --extras LIST   comma-separated extras (default: eventhubs,loganalytics; "" for none; "all").
  --python PY     interpreter for the venv (>= 3.10 with venv/ensurepip). Default: the VM
                  extension's choice ($SEFWD_EXT_PYTHON), else the first of python3.13
                  python3.12 python3.11 python3.10 python3 that qualifies.
  --prefix DIR    install under DIR instead of / (also $PREFIX): DIR/opt/sefwd/venv,
                  DIR/etc/sefwd, DIR/var/lib/sefwd, DIR/etc/systemd/system. systemctl is never
                  called with a prefix. The venv is only usable at DIR/opt/sefwd/venv.
  --no-user       do not create the sefwd user nor chown anything (implied when not root).
  --no-start      do not enable/start the service (implied without a running systemd).
  -h, --help      this text.

Layout: /opt/sefwd/venv (the agent), /etc/sefwd/config.toml (0640 root:sefwd, kept if present),
/etc/sefwd/env (secrets, 0600 root:root), /var/lib/sefwd and /var/log/sefwd (sefwd:sefwd 0750),
/etc/systemd/system/sefwd.service, /usr/local/bin/sefwd (symlink), /opt/sefwd/uninstall.sh.
EOF
}

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }
# A URL's user:password@ and its query (a SAS token's sig=) never reach a log, a file or the screen.
redact() { sed -E -e 's#([A-Za-z][A-Za-z0-9+.-]*://)[^/@[:space:]]*@#\1***@#g' -e 's#(://[^?[:space:]]*)\?[^[:space:]"'"'"']*#\1?***#g'; }
has_credential() { [[ "$1" =~ ^[A-Za-z0-9+.-]+://[^/?#]*@ ]] || [[ "$1" == *://*\?* ]]; }
read_secret_file() {  # FILE OPTION: the first line of FILE, trimmed; a warning if others may read it
    [ -f "$1" ] && [ -r "$1" ] || die "$2 $1: not a readable file"
    if [ -n "$(find "$1" -maxdepth 0 -perm /077 2>/dev/null)" ]; then
        echo "install.sh: warning: $2 $1 may be read by other users (chmod 600 it)" >&2
    fi
    local line
    IFS= read -r line <"$1" || [ -n "$line" ] || die "$2 $1: empty"
    line="${line%$'\r'}"
    line="${line#"${line%%[![:space:]]*}"}"
    printf '%s' "${line%"${line##*[![:space:]]}"}"
}

# INDEX_URL's credential, if any, into a 0600 netrc file for pip (NETRC_FILE) and out of INDEX_URL.
# (A query string cannot go there and would reach a command line: refused earlier, whatever it holds.)
index_netrc() {  # PY_VERSION (of the Python whose netrc parser pip uses)
    [ -n "$INDEX_URL" ] || return 0
    [[ "$INDEX_URL" =~ ^([A-Za-z0-9+.-]+://)([^/?#@]*)@([^/?#:]+)(.*)$ ]] || return 0
    local scheme="${BASH_REMATCH[1]}" userinfo="${BASH_REMATCH[2]//%/\\x}" host="${BASH_REMATCH[3]}" rest="${BASH_REMATCH[4]}"
    local login password=""  # percent-escapes decoded by printf %b
    login="$(printf '%b' "${userinfo%%:*}")"
    [[ "$userinfo" != *:* ]] || password="$(printf '%b' "${userinfo#*:}")"
    case "$login$password" in
        *[[:space:]\"]*) die "--index-url-file: the index URL's user or token holds a space or a quote, which a netrc file cannot carry" ;;
    esac
    if [ -z "$password" ]; then
        # A bare token is the user with an empty password (what pip sends for it). Python 3.10's netrc
        # parser cannot read an empty password; 3.11's reads "".
        case "$1" in
            3.10) die "--index-url-file: a token without a password (https://TOKEN@host/...) cannot be handed to pip off its command line under Python 3.10 (its netrc parser needs a password): give it as https://TOKEN:x@host/... if your index ignores the password, or install with Python >= 3.11 (--python)" ;;
        esac
        password='""'
    fi
    (umask 077; printf 'machine %s login %s password %s\n' "$host" "$login" "$password" >"$WORK/netrc")
    INDEX_URL="$scheme$host$rest"
    NETRC_FILE="$WORK/netrc"
}

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX="${PREFIX:-}"
SOURCE=""
EXTRAS="eventhubs,loganalytics"
PYTHON=""
MANAGE_USER=1
START=1
SERVICE_USER=sefwd
DIST=scheduled-events-forwarder
SOURCE_FILE=""
INDEX_URL_FILE=""
INDEX_URL=""
INDEX_FALLBACK=0
PROJECT_FILE=""
BUILD_DIR=""
WHEELHOUSE=""
[ -d "$HERE/../wheelhouse" ] && WHEELHOUSE="$(cd "$HERE/../wheelhouse" && pwd)"

while [ $# -gt 0 ]; do
    case "$1" in
        --source) [ $# -ge 2 ] || die "--source needs a value"; SOURCE="$2"; shift 2 ;;
        --source=*) SOURCE="${1#*=}"; shift ;;
        --source-file) [ $# -ge 2 ] || die "--source-file needs a value"; SOURCE_FILE="$2"; shift 2 ;;
        --source-file=*) SOURCE_FILE="${1#*=}"; shift ;;
        --index-url-file) [ $# -ge 2 ] || die "--index-url-file needs a value"; INDEX_URL_FILE="$2"; shift 2 ;;
        --index-url-file=*) INDEX_URL_FILE="${1#*=}"; shift ;;
        --extras) [ $# -ge 2 ] || die "--extras needs a value"; EXTRAS="$2"; shift 2 ;;
        --extras=*) EXTRAS="${1#*=}"; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs a value"; PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a value"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --no-user) MANAGE_USER=0; shift ;;
        --no-start) START=0; shift ;;
        --index-fallback) INDEX_FALLBACK=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

if has_credential "$SOURCE"; then
    die "--source $(printf '%s' "$SOURCE" | redact) carries a credential, which ps shows to every local user: put the URL in a file (mode 0600) and pass --source-file FILE"
fi
if [ -n "$SOURCE_FILE" ]; then
    [ -z "$SOURCE" ] || die "give --source or --source-file, not both"
    SOURCE="$(read_secret_file "$SOURCE_FILE" --source-file)"
fi
[ -z "$INDEX_URL_FILE" ] || INDEX_URL="$(read_secret_file "$INDEX_URL_FILE" --index-url-file)"
if [[ "$INDEX_URL" == *\?* ]]; then  # refused before anything is installed
    die "--index-url-file: the index URL has a query string ($(printf '%s' "$INDEX_URL" | redact)): pip passes the index URL to the pip it starts for build dependencies on its command line, which ps shows every local user, and only a user:token@ part can be moved off it (into a netrc file). Put the token in the URL as https://user:TOKEN@host/... or https://TOKEN@host/..."
fi
EXTRAS="$(printf '%s' "$EXTRAS" | tr -d ' ')"
case "$EXTRAS" in *[!A-Za-z0-9,_-]*) die "--extras: expected names separated by commas, got '$EXTRAS'" ;; esac

IS_ROOT=0
[ "$(id -u)" -eq 0 ] && IS_ROOT=1
if [ -n "$PREFIX" ]; then
    mkdir -p "$PREFIX"
    PREFIX="$(cd "$PREFIX" && pwd)"
    [ "$PREFIX" = / ] && PREFIX=""
fi
if [ -z "$PREFIX" ] && [ "$IS_ROOT" -eq 0 ]; then
    die "run as root (sudo), or pass --prefix DIR for an install into a scratch root"
fi
if [ "$MANAGE_USER" -eq 1 ] && [ "$IS_ROOT" -eq 0 ]; then
    say "not root: skipping the $SERVICE_USER user and file ownership (as with --no-user)"
    MANAGE_USER=0
fi
SYSTEMD=0
# A prefix is a different root: its unit is not this host's business. Containers and chroots
# often have systemctl but no running systemd (sd_booted checks the same directory).
if [ -z "$PREFIX" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    SYSTEMD=1
fi

for f in sefwd.service config.toml uninstall.sh; do
    [ -f "$HERE/$f" ] || die "$HERE/$f is missing (run install.sh from its deploy/linux directory)"
done

# -- the interpreter ---------------------------------------------------------------------------
python_ok() {
    "$1" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 10) else 3)' >/dev/null 2>&1
}
if [ -n "$PYTHON" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "--python $PYTHON: not found"
    if ! python_ok "$PYTHON"; then
        die "$PYTHON is not Python >= 3.10 with venv and ensurepip (Debian/Ubuntu: apt-get install python3-venv, or python3.X-venv for $PYTHON)"
    fi
else
    for candidate in ${SEFWD_EXT_PYTHON:-} python3.13 python3.12 python3.11 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            PYTHON="$candidate"
            break
        fi
    done
    if [ -z "$PYTHON" ]; then
        have="$(command -v python3 >/dev/null 2>&1 && python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' || echo none)"
        die "need Python >= 3.10 with venv (python3 here: $have). Debian 12/Ubuntu 22.04 or newer: apt-get install python3-venv; RHEL/Rocky/Alma/Oracle 8 and 9: dnf install python3.12; SLES 15: zypper install python311 (docs/install.md)"
    fi
fi
# The real interpreter, not a wrapper (pyenv shims, alternatives): that is what the venv uses.
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"
PY_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

# -- what pip installs -------------------------------------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/sefwd-install.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# Every credential in the index URL (user:token@ or a bare token@) goes into a netrc file instead:
# pip hands its index URL to the pip it starts for build dependencies on that one's command line,
# which `ps` shows every local user (a source checkout, as cloud-init installs, always builds).
index_netrc "$PY_VERSION"

PIP_SOURCE_ARGS=()
if [ -n "$WHEELHOUSE" ]; then
    if [ -f "$HERE/../SHA256SUMS" ]; then
        (cd "$HERE/.." && sha256sum --check --quiet --strict SHA256SUMS) >&2 \
            || die "the bundle in $(cd "$HERE/.." && pwd) does not match its SHA256SUMS (a damaged or altered copy)"
    fi
    PIP_SOURCE_ARGS=(--find-links "$WHEELHOUSE")
    [ "$INDEX_FALLBACK" -eq 1 ] || PIP_SOURCE_ARGS+=(--no-index)
    say "installing from the bundle's wheelhouse $WHEELHOUSE${PIP_SOURCE_ARGS[2]:+ (no package index)}"
fi
if [ -z "$SOURCE" ]; then
    bundled_wheels=()
    [ -z "$WHEELHOUSE" ] || bundled_wheels=("$WHEELHOUSE"/scheduled_events_forwarder-*.whl)
    if [ -n "$WHEELHOUSE" ] && [ -f "${bundled_wheels[0]}" ]; then
        [ "${#bundled_wheels[@]}" -eq 1 ] || die "$WHEELHOUSE holds ${#bundled_wheels[@]} wheels of the project: which one? (--source)"
        SOURCE="${bundled_wheels[0]}"
    elif [ -f "$HERE/../../pyproject.toml" ]; then
        SOURCE="$(cd "$HERE/../.." && pwd)"
    else
        SOURCE="$DIST"
    fi
fi
EXTRAS_SPEC=""
[ -n "$EXTRAS" ] && EXTRAS_SPEC="[$EXTRAS]"
if [ -d "$SOURCE" ]; then
    [ -f "$SOURCE/pyproject.toml" ] || die "--source $SOURCE: a directory without pyproject.toml"
    # Build from a copy: an in-tree build writes build/ and *.egg-info into the checkout, which
    # may be read-only or belong to another user.
    mkdir "$WORK/src"
    (cd "$SOURCE" && tar --exclude=.git --exclude=.venv --exclude=venv --exclude=node_modules \
        --exclude=__pycache__ --exclude='*.egg-info' --exclude=./build --exclude=./dist \
        --exclude=.pytest_cache --exclude=.mypy_cache --exclude=.ruff_cache --exclude=.hypothesis \
        --exclude=./benchmarks/results/tmp \
        -cf - .) | (cd "$WORK/src" && tar -xf -)
    # Built into a wheel first (below, with the index settings): the project is then reinstalled from that one file.
    BUILD_DIR="$WORK/src"
    REQUIREMENT="$SOURCE$EXTRAS_SPEC"
elif [ -f "$SOURCE" ]; then
    PROJECT_FILE="$(cd "$(dirname "$SOURCE")" && pwd)/$(basename "$SOURCE")"
    REQUIREMENT="$PROJECT_FILE$EXTRAS_SPEC"
elif [[ "$SOURCE" == *://* ]] && has_credential "$SOURCE"; then
    [[ "$SOURCE" != git+* ]] || die "a git URL with a credential would reach git's command line: use a git credential helper, or a wheel URL with --source-file"
    # Python fetches it (URL read from a 0600 file, never an argument); pip installs the local file,
    # so neither pip's output nor the venv's direct_url.json ever holds the credential.
    WHEEL_NAME="$(basename "${SOURCE%%[?#]*}")"
    [[ "$WHEEL_NAME" =~ ^[A-Za-z0-9_.+-]+\.(whl|tar\.gz|zip)$ ]] || die "--source-file: the URL must name a wheel or sdist file (…/name-version-….whl)"
    (umask 077; printf '%s' "$SOURCE" >"$WORK/source.url"; mkdir "$WORK/download")
    say "downloading $(printf '%s' "$SOURCE" | redact)"
    "$PYTHON" - "$WORK/source.url" "$WORK/download/$WHEEL_NAME" <<'PY' || die "downloading the --source-file URL failed"
import base64, sys, urllib.error, urllib.parse, urllib.request
url = open(sys.argv[1]).read().strip()
parts = urllib.parse.urlsplit(url)
headers = {}
if parts.username is not None:
    user, password = urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
    headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    url = urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
try:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=120) as r, open(sys.argv[2], "wb") as f:
        while chunk := r.read(1 << 16):
            f.write(chunk)
except (OSError, ValueError) as exc:  # never the URL: it holds the credential
    code = getattr(exc, "code", None)
    sys.exit(f"install.sh: error: download failed: {'HTTP %s' % code if code else type(exc).__name__}")
PY
    PROJECT_FILE="$WORK/download/$WHEEL_NAME"
    REQUIREMENT="$PROJECT_FILE$EXTRAS_SPEC"
elif [[ "$SOURCE" == *://* ]]; then
    REQUIREMENT="$DIST$EXTRAS_SPEC @ $SOURCE"
elif [[ "$SOURCE" == *"["* ]] || [ -z "$EXTRAS_SPEC" ]; then
    REQUIREMENT="$SOURCE"
elif [[ "$SOURCE" =~ ^([A-Za-z0-9._-]+)(.*)$ ]]; then
    REQUIREMENT="${BASH_REMATCH[1]}$EXTRAS_SPEC${BASH_REMATCH[2]}"
else
    die "--source $SOURCE: not a directory, file, URL or requirement"
fi

# -- the venv ----------------------------------------------------------------------------------
OPT="$PREFIX/opt/sefwd"
VENV="$OPT/venv"
mkdir -p "$OPT"
chmod 0755 "$OPT"
if [ -x "$VENV/bin/python" ]; then
    have="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
    if [ "$have" != "$PY_VERSION" ]; then
        # Site-packages are per minor version: a venv of another Python cannot be upgraded in place.
        say "replacing the venv of Python ${have:-?} with one of Python $PY_VERSION"
        rm -rf "$VENV"
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PYTHON (Python $PY_VERSION)"
    "$PYTHON" -m venv "$VENV"
fi
say "pip install $(printf '%s' "$REQUIREMENT" | redact)"
# --upgrade: a re-run with a PyPI source moves to the newest release; local sources always reinstall.
# The index URL (with its token) goes to pip in its environment, never as an argument; whatever pip
# prints goes through redact (pip hides a password, not a query).
(
    [ -z "$INDEX_URL" ] || export PIP_INDEX_URL="$INDEX_URL"
    [ -z "${NETRC_FILE:-}" ] || export NETRC="$NETRC_FILE"
    pip=("$VENV/bin/python" -m pip install --no-input --disable-pip-version-check --progress-bar off ${PIP_SOURCE_ARGS[@]+"${PIP_SOURCE_ARGS[@]}"})
    if [ -n "$BUILD_DIR" ]; then
        "$VENV/bin/python" -m pip wheel --no-input --disable-pip-version-check --progress-bar off --no-deps \
            ${PIP_SOURCE_ARGS[@]+"${PIP_SOURCE_ARGS[@]}"} --wheel-dir "$WORK/wheel" "$BUILD_DIR" || exit
        PROJECT_FILE="$(ls "$WORK"/wheel/*.whl)"
        REQUIREMENT="$PROJECT_FILE$EXTRAS_SPEC"
    fi
    "${pip[@]}" --upgrade "$REQUIREMENT" || exit
    # The project itself again, for real: a build with the same version number (or an older one)
    # would otherwise be "already installed" and keep the old code. Its dependencies stay as they are.
    [ -z "${PROJECT_FILE:-}" ] || exec "${pip[@]}" --force-reinstall --no-deps "$PROJECT_FILE"
) 2>&1 | redact || die "pip install failed (the VM needs access to the package index, or pass a wheel with --source, or use the offline bundle)"
"$VENV/bin/sefwd" --help >/dev/null || die "the installed $VENV/bin/sefwd does not run"
VERSION="$("$VENV/bin/python" -I -c 'from importlib.metadata import version; print(version("scheduled-events-forwarder"))')"
install -m 0755 "$HERE/uninstall.sh" "$OPT/uninstall.sh"
[ -f "$HERE/README.md" ] && install -m 0644 "$HERE/README.md" "$OPT/README.md"

# -- the service user --------------------------------------------------------------------------
CREATED_USER=no
if [ -f "$OPT/install.env" ] && grep -qx 'SEFWD_CREATED_USER=yes' "$OPT/install.env"; then
    CREATED_USER=yes  # an earlier run created it: uninstall.sh still removes it
fi
if [ "$MANAGE_USER" -eq 1 ] && ! getent passwd "$SERVICE_USER" >/dev/null; then
    nologin=/usr/sbin/nologin
    [ -x "$nologin" ] || nologin=/sbin/nologin
    say "creating system user $SERVICE_USER"
    useradd --system --user-group --home-dir /var/lib/sefwd --no-create-home --shell "$nologin" \
        --comment "sefwd Scheduled Events forwarder" "$SERVICE_USER"
    CREATED_USER=yes
fi
own() {  # own OWNER:GROUP PATH... (only when managing the user)
    if [ "$MANAGE_USER" -eq 1 ]; then chown "$@"; fi
}

# -- config, secrets, state, logs --------------------------------------------------------------
ETC="$PREFIX/etc/sefwd"
mkdir -p "$ETC"
chmod 0755 "$ETC"
own root:root "$ETC"
if [ -e "$ETC/config.toml" ]; then
    say "keeping $ETC/config.toml"
else
    say "writing $ETC/config.toml"
    install -m 0640 "$HERE/config.toml" "$ETC/config.toml"
fi
# Mode and owner are normalized even for a kept file (cloud-init writes it before the user exists).
chmod 0640 "$ETC/config.toml"
own "root:$SERVICE_USER" "$ETC/config.toml"
if [ ! -e "$ETC/env" ]; then
    (umask 077 && cat >"$ETC/env" <<'EOF'
# Secrets for sefwd.service as NAME=value lines (systemd EnvironmentFile= syntax), for example
#   EVENTHUBS_CONNECTION_STRING=Endpoint=sb://...;SharedAccessKeyName=send;SharedAccessKey=...
#   SEFWD_WEBHOOK_SECRET=whsec_...
# and name them in /etc/sefwd/config.toml with the sink's *_env key. Keep this file 0600 root:root.
EOF
    )
fi
chmod 0600 "$ETC/env"
own root:root "$ETC/env"
for dir in "$PREFIX/var/lib/sefwd" "$PREFIX/var/log/sefwd"; do
    mkdir -p "$dir"
    chmod 0750 "$dir"
    # Recursive: a re-created user may have a new uid, and uninstall hands kept files to root.
    own -R "$SERVICE_USER:$SERVICE_USER" "$dir"
done

# -- unit, command, record ---------------------------------------------------------------------
UNIT_DIR="$PREFIX/etc/systemd/system"
mkdir -p "$UNIT_DIR"
install -m 0644 "$HERE/sefwd.service" "$UNIT_DIR/sefwd.service"
mkdir -p "$PREFIX/usr/local/bin"
LINK="$PREFIX/usr/local/bin/sefwd"
if [ -L "$LINK" ] || [ ! -e "$LINK" ]; then
    ln -sfn ../../../opt/sefwd/venv/bin/sefwd "$LINK"
else
    say "leaving $LINK alone (not a symlink); the agent is $VENV/bin/sefwd"
fi
cat >"$OPT/install.env" <<EOF
# Written by install.sh; read by uninstall.sh (never sourced).
SEFWD_VERSION=$VERSION
SEFWD_SOURCE=$(printf '%s' "$SOURCE" | redact)
SEFWD_EXTRAS=$EXTRAS
SEFWD_PYTHON=$PYTHON
SEFWD_CREATED_USER=$CREATED_USER
SEFWD_INSTALLED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
EOF
chmod 0644 "$OPT/install.env"

if [ "$SYSTEMD" -eq 1 ]; then
    systemctl daemon-reload
    if [ "$START" -eq 1 ]; then
        systemctl enable sefwd.service
        # restart, not start: a re-install must run the new code.
        systemctl restart sefwd.service
        if systemctl is-active --quiet sefwd.service; then
            say "sefwd.service is running: journalctl -u sefwd -f"
        else
            die "sefwd.service did not start: systemctl status sefwd; journalctl -u sefwd"
        fi
    else
        say "not started (--no-start): systemctl enable --now sefwd"
    fi
elif [ "$START" -eq 1 ]; then
    say "no running systemd here (or a --prefix): not starting the service"
fi
say "installed sefwd $VERSION in $VENV (config $ETC/config.toml)"
