"""API keys: the keys file, the middleware that checks a request's key and rate, and what
a route asks of the caller's key (`gateway.auth.access`)."""
