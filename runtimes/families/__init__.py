"""runtimes/families."""
