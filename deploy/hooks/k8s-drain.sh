#!/bin/sh
# sefwd hook recipe: drain this Kubernetes node before maintenance (docs/approvals.md#recipes).
# [approval] hook_env = ["KUBECONFIG", "NODE_NAME"]
# [approval.hooks] scheduled = { command = ["/usr/local/lib/sefwd/k8s-drain.sh"], at = "notbefore - 5m",
#                               event_types = ["Reboot", "Redeploy", "Preempt", "Terminate"] }
# Pods get the time the agent gives this hook (SEFWD_SECONDS_LEFT: up to NotBefore less the
# margin), less 5 s for kubectl itself. Idempotent: draining a drained node is a no-op.
set -eu
node="${NODE_NAME:-$(hostname)}"
left="${SEFWD_SECONDS_LEFT:-300}"
grace=$(( left > 10 ? left - 5 : 1 ))
echo "draining ${node} for ${SEFWD_EVENT_TYPE:-?} ${SEFWD_EVENT_ID:-?} (grace ${grace}s, deadline ${SEFWD_DEADLINE:-none})"
exec kubectl drain "${node}" --ignore-daemonsets --delete-emptydir-data \
    --grace-period="${grace}" --timeout="${grace}s"
