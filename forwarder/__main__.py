from __future__ import annotations

import sys

from forwarder.agent.cli import main

sys.exit(main())
