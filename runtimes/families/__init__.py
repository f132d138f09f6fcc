"""Model-family logic every engine shares, without torch: text lengths and chunks, vectors,
classifier labels, entities, SPLADE pooling, prompts, token ids, streamed deltas,
sentence-transformers files. Imports no engine and no side.
"""
