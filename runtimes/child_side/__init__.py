"""The runtime process's side (`python -m runtimes.child_side.server`): it loads models
with an engine's adapters and computes batches. Nothing here is imported by the worker's
side (`runtimes.worker_side`), which reaches it only through frames (`runtimes.wire`).
"""
