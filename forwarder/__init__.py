"""scheduled-events-forwarder: Azure IMDS Scheduled Events → durable CloudEvents stream."""
from __future__ import annotations

__version__ = "0.1.0"
