"""PyTorch (transformers) engine: per model family, the primitive of its family
(`runtimes.families`) on torch and the subclass that binds it."""
