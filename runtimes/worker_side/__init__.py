"""The worker's side of its runtimes: the runtime process it starts and watches (`process`,
its two connections, `supervisor`, the spare, `bisection` of a failed batch), replicas on
one device, the router by model, and the device memory pool's bookkeeping.
"""
