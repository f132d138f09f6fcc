"""runtimes/worker_side."""
