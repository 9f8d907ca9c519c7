"""Shared helpers with no pipeline stage: value parsing, logging, retry, signing, connection strings, loopback."""
