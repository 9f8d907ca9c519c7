#!/bin/sh
# sefwd hook recipe: take this VM out of an Azure load balancer backend pool before maintenance
# ("leave"), and put it back after ("join"). Needs the Azure CLI logged in with the VM's managed
# identity (az login --identity) and these names in the agent's environment, passed on with
# [protect] hook_env = ["LB_RESOURCE_GROUP", "LB_NAME", "LB_POOL", "LB_NIC", "LB_IP_CONFIG"]:
# [protect] enter = ["/usr/local/lib/sefwd/lb-pool.sh", "leave"]
#           leave = ["/usr/local/lib/sefwd/lb-pool.sh", "join"]
#           at = "notbefore - 2m"
# Once per hold of this VM (overlapping events: one leave, one join after the last ended).
# Idempotent: leaving a pool twice or joining twice changes nothing.
set -eu
case "${1:-}" in
    leave) verb=remove ;;
    join) verb=add ;;
    *) echo "usage: $0 leave|join" >&2; exit 2 ;;
esac
echo "${1} pool ${LB_NAME}/${LB_POOL} for ${SEFWD_EVENT_ID:-?}"
exec az network nic ip-config address-pool "${verb}" \
    --resource-group "${LB_RESOURCE_GROUP}" --nic-name "${LB_NIC}" --ip-config-name "${LB_IP_CONFIG:-ipconfig1}" \
    --lb-name "${LB_NAME}" --address-pool "${LB_POOL}"
