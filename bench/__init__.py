"""The repository's benchmarks for shoal, one file each (`python -m bench.<name>`; what each
measures and its last results are in BENCHMARKS.md). What they share is in `bench/lib/`
and in the product's `app.tuning` (load generator, knee, mix, statistics, markdown
tables, private stack); they import the product, never the reverse."""
