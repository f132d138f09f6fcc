"""runtimes/child_side."""
