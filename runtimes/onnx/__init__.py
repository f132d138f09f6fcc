"""ONNX Runtime adapters: the encoder families without torch (docs/runtimes.md, "ONNX")."""
