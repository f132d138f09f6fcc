"""What the benchmarks share and that is not a benchmark: argument types (`args`), where
results go (`output`), plots (`plot`), and bench.faults' fleet in network namespaces
(`faults_fleet`) and its load (`faults_load`). The load generator, knee finder, request
mix, CPU accounting, statistics, markdown tables and the private stack are the product's
(`app.tuning`): `shoal bench` and `shoal tune` use them too."""
