"""`shoal onboard`: turn a model's own files into a verified, tuned catalog entry.

files (read and check a model folder) -> detect (the adapter family and its settings,
each with the file it came from) -> parity (shoal's adapter against the model's reference
library) -> tune (the knee per runtime and precision on this device) -> entry (a commented
YAML file in the user's catalog folder). `catalog_run` repeats verify + tune over a whole
catalog and `report` draws what it found.
"""
