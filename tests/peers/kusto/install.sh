#!/bin/sh
# Install Microsoft's Kusto language service (npm @kusto/language-service-next, pinned by
# package-lock.json) for tests/unit/test_kql.py, which checks every KQL query the project ships.
# Used by tests/peers/install.sh; needs node >= 18 and npm.
set -eu
cd "$(dirname "$0")"
exec npm ci --no-audit --no-fund --loglevel=error
