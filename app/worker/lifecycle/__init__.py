"""A request's life on a worker: held, scheduled, run, answered or given back.

`dispatcher.Dispatcher` owns the loop; every other module here is one of its
collaborators, which never import it (an import-linter contract keeps it so).
"""
