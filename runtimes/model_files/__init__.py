"""runtimes/model_files."""
