"""Model execution: adapters per model family and the host that runs batches.

Knows nothing of RabbitMQ or HTTP: it takes decoded requests and returns
results as plain msgpack-able data, so the same code can run in the worker's
thread today and behind a socket in its own process later.
"""
