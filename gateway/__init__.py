"""The HTTP gateway: parse little, annotate, publish, await the reply.

Imports nothing heavy (no torch, transformers or numpy).
"""
