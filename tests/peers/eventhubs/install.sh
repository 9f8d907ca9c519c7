#!/bin/sh
# The README's and CI's entry point: installs the Event Hubs peer's npm dependencies. The peer
# itself (server.js, package.json) lives in benchmarks/peers/eventhubs, which tests and benchmarks share.
set -eu
exec sh "$(dirname "$0")/../../../benchmarks/peers/eventhubs/install.sh"
