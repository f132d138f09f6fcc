"""What `shoal bench` and `shoal tune` run on (their command lines are app/cli/bench.py and
app/cli/tune.py), and what the repository's benchmarks (bench/) and end-to-end tests
build on:

- `load`: closed- and open-loop HTTP load against one endpoint (`rawhttp`, a minimal
  keep-alive client; `cpu`, each process's CPU over the measured window);
- `mix`: the request mix (texts per request, words per text) from short specs;
- `knee`: the knee of a load curve and when a sweep stops;
- `tune`: the tuner (cost fit, coordinate search, catalog profile write-back);
- `inproc`: a dense model's in-process ceiling, and the machine it ran on;
- `stack`: start, watch and stop a private gateway + workers + Flower on one queue
  prefix; `bench_stack`: such a stack for one run, ready once a request goes through;
- `stats`: the one percentile, median and ratio; `markdown`: the one markdown table
  and its cells ("n/a" or "-" for a missing figure);
- `plot`: the PNG of a load sweep.

Nothing here imports bench/ or tests/.
"""
