"""What every request passes through, knowing nothing of models: the HTTP protocol's
limits, the outermost middleware, the drain on SIGTERM, body codecs, the error type and
the gateway's Prometheus metrics. The bottom of the gateway: imports no other part of it.
"""
