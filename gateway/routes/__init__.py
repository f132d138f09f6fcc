"""The HTTP handlers: the native API, the OpenAI routes, jobs, health and /v1/models.

The top of the gateway below `gateway.app`: a route may import `gateway.jobs`,
`gateway.calls`, `gateway.auth`, `gateway.broker` and `gateway.edge`; none of those
imports a route.
"""
