#!/bin/sh
# sefwd recipe: put the node back once no event holds this VM any more (the [protect] leave).
# [protect] leave = ["/usr/local/lib/sefwd/k8s-uncordon.sh"]   (with enter = k8s-drain.sh)
# The agent runs it once per hold, only after the drain is over and the last event ended (plus
# settle); again after a crash: uncordon is idempotent. A node that was cordoned before the drain
# (k8s-drain.sh noted it) stays cordoned: undo only what we did.
# The old per-change form ([approval.hooks] completed/canceled/ended = ...) still works: it uncordons.
set -eu
node="${NODE_NAME:-$(hostname)}"
if [ -n "${SEFWD_HOLD_DIR:-}" ]; then
    mark="${SEFWD_HOLD_DIR}/k8s-${node}.hold"
    if grep -qx 'cordoned_before=true' "${mark}" 2>/dev/null; then
        echo "leaving ${node} cordoned: it was cordoned before hold ${SEFWD_HOLD_ID:-?} drained it"
        rm -f "${mark}"
        exit 0
    fi
    echo "uncordoning ${node} after hold ${SEFWD_HOLD_ID:-?} (${SEFWD_HOLD_EVENTS:-?})"
    kubectl uncordon "${node}"
    rm -f "${mark}"
    exit 0
fi
echo "uncordoning ${node} after ${SEFWD_CHANGE:-?} ${SEFWD_EVENT_ID:-?}"
exec kubectl uncordon "${node}"
