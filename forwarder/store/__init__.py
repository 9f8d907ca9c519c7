"""The durable stage: one SQLite database (records, cursors, state), its recovery, and the outbox protocol the poller commits to."""
