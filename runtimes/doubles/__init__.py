"""runtimes/doubles."""
