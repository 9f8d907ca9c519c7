#!/usr/bin/env bash
# Remove what deploy/linux/install.sh installed. Config, secrets, state and logs stay unless
# --purge. install.sh also copies this script to /opt/sefwd/uninstall.sh (which it deletes).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: uninstall.sh [--purge] [--prefix DIR]

Stops and disables sefwd.service and removes the unit, /opt/sefwd (the venv), the
/usr/local/bin/sefwd symlink and the sefwd user (only if install.sh created it).
Kept unless --purge: /etc/sefwd (config.toml, env), /var/lib/sefwd (undelivered records,
dead letters), /var/log/sefwd, and drop-ins in /etc/systemd/system/sefwd.service.d;
without --purge, kept files are handed to root:root before the user is deleted.
  --purge         remove those as well: nothing of sefwd is left.
  --prefix DIR    uninstall from DIR instead of / (also $PREFIX); systemctl is not called.
  -h, --help      this text.
A service manager that fails, hangs (each call is bounded: disable --now 60 s, daemon-reload
30 s) or is absent does not stop the uninstall: it is reported as a warning and the rest is
removed; the exit status is 0. Running it again is harmless.
$SEFWD_SYSTEMCTL, if set, is the command called instead of systemctl (same arguments), also
with --prefix (tests use it to stand in for a failing or missing service manager);
$SEFWD_SYSTEMCTL_LIMIT (seconds), if set, shortens every call's limit to at most that.
EOF
}

die() { echo "uninstall.sh: error: $*" >&2; exit 1; }
say() { echo "uninstall.sh: $*"; }
warn() { echo "uninstall.sh: warning: $*" >&2; }

# systemctl ARGS (or $SEFWD_SYSTEMCTL ARGS) within LIMIT seconds. A failure, a hang or a missing
# service manager is a warning, never the end of the uninstall: the venv and the unit must go
# whatever state systemd is in (the VM extension's uninstall relies on it). Output goes to a file,
# not a pipe, so a killed command's children cannot hold us.
svc() {
    local limit="$1" quiet="$2" rc=0 out cmd=(systemctl)
    shift 2
    if [ -n "${SEFWD_SYSTEMCTL:-}" ]; then read -r -a cmd <<<"$SEFWD_SYSTEMCTL"; fi
    if [[ "${SEFWD_SYSTEMCTL_LIMIT:-}" =~ ^[1-9][0-9]*$ ]] && [ "$SEFWD_SYSTEMCTL_LIMIT" -lt "$limit" ]; then
        limit="$SEFWD_SYSTEMCTL_LIMIT"
    fi
    out="$(mktemp 2>/dev/null)" || out=""
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 5 "$limit" "${cmd[@]}" "$@" >"${out:-/dev/null}" 2>&1 </dev/null || rc=$?
    else
        "${cmd[@]}" "$@" >"${out:-/dev/null}" 2>&1 </dev/null || rc=$?
    fi
    if [ "$rc" -ne 0 ] && [ "$quiet" != quiet ]; then
        local why="exit $rc" said=""
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="did not finish within ${limit} s"; fi
        if [ "$rc" -eq 127 ]; then why="not found"; fi
        if [ -n "$out" ]; then said="$(tr '\n' ' ' <"$out" | cut -c1-300)"; fi
        warn "${cmd[*]} $* failed ($why)${said:+: $said}; ignored, going on"
    fi
    if [ -n "$out" ]; then rm -f "$out"; fi
    return 0
}

# Everything runs from main: bash reads a script as it goes, and this file may delete itself.
main() {
    local prefix="${PREFIX:-}" purge=0 is_root=0 systemd=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --purge) purge=1; shift ;;
            --prefix) [ $# -ge 2 ] || die "--prefix needs a value"; prefix="$2"; shift 2 ;;
            --prefix=*) prefix="${1#*=}"; shift ;;
            -h|--help) usage; exit 0 ;;
            *) usage >&2; die "unknown argument: $1" ;;
        esac
    done
    [ "$(id -u)" -eq 0 ] && is_root=1
    if [ -n "$prefix" ]; then
        [ -d "$prefix" ] || { say "$prefix does not exist: nothing to remove"; exit 0; }
        prefix="$(cd "$prefix" && pwd)"
        [ "$prefix" = / ] && prefix=""
    fi
    [ -n "$prefix" ] || [ "$is_root" -eq 1 ] || die "run as root (sudo), or pass --prefix DIR"
    if [ -n "${SEFWD_SYSTEMCTL:-}" ]; then
        systemd=1
    elif [ -z "$prefix" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemd=1
    fi

    local opt="$prefix/opt/sefwd" unit="$prefix/etc/systemd/system/sefwd.service"
    local link="$prefix/usr/local/bin/sefwd" created_user=no
    if [ -f "$opt/install.env" ] && grep -qx 'SEFWD_CREATED_USER=yes' "$opt/install.env"; then
        created_user=yes
    fi

    local unit_removed=0
    if [ -e "$unit" ] || { [ "$purge" -eq 1 ] && [ -e "$unit.d" ]; }; then
        unit_removed=1
    fi
    if [ "$systemd" -eq 1 ] && [ -e "$unit" ]; then
        # Stops the agent with SIGTERM: it drains for drain_timeout (TimeoutStopSec=30s); the store keeps the rest.
        svc 60 loud disable --now sefwd.service
    fi
    rm -f "$unit"
    if [ "$purge" -eq 1 ]; then
        rm -rf "$unit.d"
    fi
    if [ "$systemd" -eq 1 ] && [ "$unit_removed" -eq 1 ]; then
        svc 30 loud daemon-reload
        svc 10 quiet reset-failed sefwd.service
    fi
    if [ -L "$link" ] && [ "$(readlink "$link")" = ../../../opt/sefwd/venv/bin/sefwd ]; then
        rm -f "$link"
    fi
    rm -rf "$opt"
    say "removed the unit and $opt"

    local kept=("$prefix/etc/sefwd" "$prefix/var/lib/sefwd" "$prefix/var/log/sefwd")
    if [ "$purge" -eq 1 ]; then
        rm -rf "${kept[@]}"
        say "purged config, secrets, state and logs"
    else
        for path in "${kept[@]}"; do
            [ -e "$path" ] && say "kept $path (remove with --purge)"
        done
    fi

    if [ "$created_user" = yes ] && [ "$is_root" -eq 1 ] && getent passwd sefwd >/dev/null; then
        if [ "$purge" -eq 0 ]; then
            # A later system user could get the freed uid and with it the kept secrets and records.
            for path in "${kept[@]}"; do
                if [ -e "$path" ]; then chown -R root:root "$path"; fi
            done
        fi
        if userdel sefwd; then
            if getent group sefwd >/dev/null; then groupdel sefwd 2>/dev/null || true; fi
            say "removed user sefwd"
        else
            # Typically the agent still runs (the service manager could not stop it).
            warn "user sefwd not removed (still in use?): remove it with 'userdel sefwd' once sefwd has stopped"
        fi
    fi
}

main "$@"
