"""The agent wiring: CLI, configuration, service, poller, status, telemetry and the extension heartbeat."""
