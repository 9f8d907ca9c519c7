#!/bin/sh
# sefwd undo hook recipe: put the node back once the event is over (completed, canceled or ended).
# [approval.hooks] completed = ["/usr/local/lib/sefwd/k8s-uncordon.sh"]   (same for canceled, ended)
# An undo hook runs to completion once per event, again after a crash: uncordon is idempotent.
set -eu
node="${NODE_NAME:-$(hostname)}"
echo "uncordoning ${node} after ${SEFWD_CHANGE:-?} ${SEFWD_EVENT_ID:-?}"
exec kubectl uncordon "${node}"
