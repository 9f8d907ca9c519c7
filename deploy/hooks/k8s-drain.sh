#!/bin/sh
# sefwd recipe: drain this Kubernetes node before maintenance (docs/approvals.md#recipes).
# [protect] enter = ["/usr/local/lib/sefwd/k8s-drain.sh"]
#           leave = ["/usr/local/lib/sefwd/k8s-uncordon.sh"]
#           at = "notbefore - 5m"
#           hook_env = ["KUBECONFIG", "NODE_NAME"]
# The agent runs it once per hold of this VM (overlapping events: one drain), and again after a
# crash cut it short: draining a drained node is a no-op. Pods get the time the agent gives
# (SEFWD_SECONDS_LEFT: up to NotBefore less the margin), less 5 s for kubectl itself.
# Under [protect] (SEFWD_HOLD_DIR set) it first notes, once per hold, whether the node was already
# cordoned (by an admin): k8s-uncordon.sh then leaves such a node cordoned (undo only what we did).
# The old per-change form ([approval.hooks] scheduled = ...) still works, without that note.
set -eu
node="${NODE_NAME:-$(hostname)}"
left="${SEFWD_SECONDS_LEFT:-300}"
grace=$(( left > 10 ? left - 5 : 1 ))
if [ -n "${SEFWD_HOLD_DIR:-}" ]; then
    mark="${SEFWD_HOLD_DIR}/k8s-${node}.hold"
    if [ "$(sed -n 's/^hold=//p' "${mark}" 2>/dev/null || true)" != "${SEFWD_HOLD_ID:-}" ]; then
        was=$(kubectl get node "${node}" -o 'jsonpath={.spec.unschedulable}' 2>/dev/null || true)
        printf 'hold=%s\ncordoned_before=%s\n' "${SEFWD_HOLD_ID:-}" "${was:-false}" > "${mark}.tmp"
        mv "${mark}.tmp" "${mark}"
    fi
fi
echo "draining ${node} for ${SEFWD_EVENT_TYPE:-?} ${SEFWD_HOLD_EVENTS:-${SEFWD_EVENT_ID:-?}} (grace ${grace}s, deadline ${SEFWD_DEADLINE:-none})"
exec kubectl drain "${node}" --ignore-daemonsets --delete-emptydir-data \
    --grace-period="${grace}" --timeout="${grace}s"
