"""Loopback peers shared by the benchmarks and the tests: a webhook receiver, the Logs Ingestion and
App Insights track endpoints, and the Node.js Event Hubs AMQP peer (``eventhubs/``; its npm
dependencies: ``sh benchmarks/peers/eventhubs/install.sh``).

They live here, not under ``tests/``, so that ``python -m benchmarks`` needs only the ``[bench]``
extra and never imports the test suite; the tests import them from here. Peers only the tests use
stay in ``tests/peers``."""
