"""Benchmarks of the agent: poll cost next to the seed's sample, journal throughput, backlog drain."""
