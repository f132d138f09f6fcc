"""runtimes/wire."""
