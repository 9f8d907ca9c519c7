#!/bin/sh
# The README's and CI's entry point for the test peers that do not come from PyPI: each peer's own
# install script (npm packages from the registry, nothing else). Add a peer here, not to the README line.
set -eu
here="$(dirname "$0")"
sh "$here/eventhubs/install.sh"
sh "$here/azurite/install.sh"
sh "$here/kusto/install.sh"
