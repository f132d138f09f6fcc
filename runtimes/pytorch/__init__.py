"""PyTorch (transformers) adapters, one module per model family."""
