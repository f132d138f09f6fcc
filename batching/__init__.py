"""Pure scheduling logic: which queued requests run together, and when.

No I/O here: every function takes plain data (and `now`) so it can be tested
without a broker, a model or a clock.
"""
