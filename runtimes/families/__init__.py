"""Model families, each written once for every engine, without torch: a family's module
(`dense`, `sparse`, `multivector`, `clip`, `causal_lm`, `classifiers`, `entities`) holds its
adapter's logic (checks, tokenizing, pooling, results) over the primitive an engine
supplies (pooled vectors, term weights, token vectors, logits, a generation step); beside
them what several share: text lengths and chunks, vectors, SPLADE pooling, prompts, token
ids, streamed deltas, sentence-transformers files. Imports no engine and no side.
"""
