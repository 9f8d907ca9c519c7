from __future__ import annotations

import sys

from forwarder.cli import main

sys.exit(main())
