"""Model execution: where a worker's batches are computed.

Knows nothing of RabbitMQ or HTTP: a batch is plain requests in and plain,
msgpack-able outcomes out (`runtimes.base`). The worker runs its models in a
child process (`runtimes.worker_side.process` spawns `runtimes.child_side.server`, which loads them
with `runtimes.child_side.host` and the per-family adapters of `runtimes.pytorch`), so a
crash costs a restart, not the worker; `runtimes.doubles.sim` stands in for a device
in fleet experiments.
"""
