#!/bin/sh
# Start handler.py with a Python it runs on: handler.sh install|enable|disable|uninstall|update.
#
# POSIX sh on purpose: the guest agent runs every command of HandlerManifest.json, and the image's
# python3 may be older than the 3.10 the agent needs (RHEL/Rocky/Alma/Oracle 8 and SLES 15: 3.6,
# RHEL 9: 3.9), with a newer one installed beside it under a versioned name. This tries those
# names newest first, then python3, and execs handler.py with the first at 3.10 or newer
# (exported as SEFWD_EXT_PYTHON for the status message and install.sh). When none fits it writes
# the command's status file itself, naming what to install on this distribution.
#
#   SEFWD_EXT_PYTHONS  the names to try, in order (tests)
#   SEFWD_EXT_ROOT     prefix for host paths (/etc/os-release), as handler.py
set -u

here=$(cd "$(dirname "$0")" && pwd)
E_NO_PYTHON=21  # handler.py's codes end below 20
candidates=${SEFWD_EXT_PYTHONS:-"python3.13 python3.12 python3.11 python3.10 python313 python312 python311 python310 python3"}
tried=""

for name in $candidates; do
    path=$(command -v "$name" 2>/dev/null) || continue
    # Parseable by any Python (2.7 and 3.6 included): prints the version, exits 0 only at 3.10+.
    version=$("$path" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3]); sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null)
    if [ $? -eq 0 ] && [ -n "$version" ]; then
        SEFWD_EXT_PYTHON="$path"
        SEFWD_EXT_PYTHON_VERSION="$version"
        export SEFWD_EXT_PYTHON SEFWD_EXT_PYTHON_VERSION
        exec "$path" "$here/handler.py" "$@"
    fi
    tried="$tried${tried:+, }$name ${version:-(no version)} at $path"
done

# -- no suitable Python: say so in the status file -------------------------------------------------
command=$(printf '%s' "${1:-}" | sed 's/^-*//' | tr 'A-Z' 'a-z')
case "$command" in
    install) operation=Install ;;
    enable) operation=Enable ;;
    disable) operation=Disable ;;
    uninstall) operation=Uninstall ;;
    update) operation=Update ;;
    *) echo "usage: handler.sh install|enable|disable|uninstall|update" >&2; exit 2 ;;
esac

os_field() {  # NAME: a field of os-release, unquoted
    sed -n "s/^$1=//p" "${SEFWD_EXT_ROOT:-}/etc/os-release" 2>/dev/null | head -n 1 | tr -d '"'"'"
}
os_id=$(os_field ID)
os_like=$(os_field ID_LIKE)
os_version=$(os_field VERSION_ID)
os_name=$(os_field PRETTY_NAME)
case " $os_id $os_like " in
    *" sles "*|*" suse "*|*" opensuse "*) remedy="zypper install python311" ;;
    *" rhel "*|*" fedora "*|*" centos "*) remedy="dnf install python3.12 (or python3.11)" ;;
    *" azurelinux "*|*" mariner "*) remedy="Azure Linux 3.0 ships Python 3.12 as python3 (tdnf install python3); CBL-Mariner 2.0 has none: move to Azure Linux 3.0" ;;
    *" ubuntu "*|*" debian "*) remedy="apt-get install python3 python3-venv (Ubuntu 22.04 and Debian 12 or newer ship 3.10+; older releases are not supported)" ;;
    *) remedy="install CPython 3.10 to 3.13 as python3.13 ... python3.10 or python3" ;;
esac
message="no Python 3.10 or newer for the sefwd handler (tried: ${tried:-none of $candidates is on PATH}). On ${os_name:-this distribution}${os_version:+ ($os_id $os_version)}: $remedy; then reapply the extension"

# Disable and uninstall must not fail: a failing disable blocks uninstall and aborts an update, and
# without a Python nothing of the agent can be running from this handler.
status=error
code=$E_NO_PYTHON
case "$command" in disable|uninstall) status=warning; code=0 ;; esac

json_escape() { printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr -d '\000-\037'; }
env_file="$here/HandlerEnvironment.json"
folder() {  # KEY: a folder of HandlerEnvironment.json (a flat string field; \/ unescaped)
    tr -d '\n' <"$env_file" 2>/dev/null | sed -n "s/.*\"$1\"[[:space:]]*:[[:space:]]*\"\([^\"]*\)\".*/\1/p" | sed 's#\\/#/#g'
}
status_folder=$(folder statusFolder)
config_folder=$(folder configFolder)
seq=${ConfigSequenceNumber:-}
case "$seq" in ''|*[!0-9]*)
    # the newest <n>.settings, as handler.py picks it
    seq=$(ls -t "$config_folder" 2>/dev/null | sed -n 's/^\([0-9][0-9]*\)\.settings$/\1/p' | head -n 1)
    seq=${seq:-0} ;;
esac
if [ -n "$status_folder" ]; then
    mkdir -p "$status_folder" 2>/dev/null
    tmp="$status_folder/.$seq.status.$$"
    printf '[{"version": 1.0, "timestampUTC": "%s", "status": {"name": "sefwd", "operation": "%s", "status": "%s", "code": %s, "formattedMessage": {"lang": "en-US", "message": "%s"}}}]\n' \
        "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$operation" "$status" "$code" "$(json_escape "$message")" >"$tmp" \
        && mv -f "$tmp" "$status_folder/$seq.status"
fi
# The one line waagent reports while the handler is not installed.
if [ "$code" -eq 0 ]; then
    echo "$operation succeeded: nothing to do: $message"
else
    echo "$operation failed (code $code): $message"
fi
exit "$code"
