"""Approving Scheduled Events: policy rules, local hooks, the CLI, and the signed callback."""
