"""shoal's process wiring: settings, catalog, queue topology, the Celery app and the CLI.

Kept import-light: the gateway imports `app.settings`, `app.catalog` and
`app.topology`; only `app.celery` (the Celery app) pulls in Celery.
"""
