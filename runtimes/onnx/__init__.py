"""ONNX Runtime engine: the encoder families' primitives without torch, under the families'
own logic (`runtimes.families`; docs/runtimes.md, "ONNX")."""
