"""The frames between a worker and its runtime process, defined once for both sides:
length-prefixed msgpack (`protocol`) and the typed frames (`frames`).
"""
