#!/bin/sh
# Install and build Microsoft's Node sample client (Azure/vm-scheduled-events, node/ at commit
# a72159318839609dcccb58ab3e8debe96c52db45, MIT, see LICENSE) with the versions its own
# package-lock.json pins. Its sources are unchanged but for the IMDS URL, which comes from
# $SAMPLE_IMDS_URL. Needs node >= 18 and npm. Used by tests/integration/test_node_sample.py.
set -eu
cd "$(dirname "$0")"
if [ -f package-lock.json ]; then
    npm ci --no-audit --no-fund --loglevel=error
else
    npm install --no-audit --no-fund --loglevel=error
fi
exec node_modules/.bin/tsc
