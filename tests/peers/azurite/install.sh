#!/bin/sh
# Install Azurite (the Azure Storage emulator; its table service backs the remote approver's shared-state
# tests and benchmark), pinned by package-lock.json. Needs node >= 18 and npm; node_modules is not committed.
set -eu
cd "$(dirname "$0")"
exec npm ci --no-audit --no-fund --loglevel=error
