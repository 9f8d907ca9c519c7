"""The delivery stage: per-sink workers reading the store, and re-sending dead letters."""
