#!/bin/sh
# sefwd hook recipe: stop a service gracefully before maintenance, within the time left.
# [protect] enter = ["/usr/local/lib/sefwd/service-stop.sh"]
#           leave = "systemctl start \"$SERVICE\""
#           at = "notbefore - 1m"
#           hook_env = ["SERVICE"]
# systemctl stop waits for the unit's own stop timeout; `timeout` bounds it by SEFWD_SECONDS_LEFT
# (the agent would stop the hook then anyway, but the unit then is left stopping, not stopped).
set -eu
left="${SEFWD_SECONDS_LEFT:-90}"
echo "stopping ${SERVICE} within ${left}s (${SEFWD_EVENT_TYPE:-?} ${SEFWD_EVENT_ID:-?})"
exec timeout "${left}" systemctl stop "${SERVICE}"
