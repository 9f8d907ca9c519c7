#!/bin/sh
# Install the Event Hubs test peer's npm dependencies (rhea, ws; pinned by package-lock.json).
# Used by .ci/run; needs node >= 18 and npm.
set -eu
cd "$(dirname "$0")"
exec npm ci --no-audit --no-fund --loglevel=error
