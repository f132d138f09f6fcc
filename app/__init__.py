"""shoal's processes: the worker (`app.worker`) and the `shoal` command.

Everything the processes share (settings, catalog, queue topology, the Celery app) is
the contract below, in `tasks/`; nothing under `tasks/`, `batching/`, `runtimes/` or
`gateway/` imports this package.
"""
