"""What the benchmarks share and that is not a benchmark: argument types (`args`), where
results go (`output`), plots (`plot`). The load generator, knee finder, request mix, CPU
accounting and the private stack are the product's (`app.tuning`): `shoal bench` and
`shoal tune` use them too."""
