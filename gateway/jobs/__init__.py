"""Jobs behind /v1/jobs (its HTTP handlers are `gateway.routes.job_routes`): their state
in Redis, the driver that publishes their parts, the shared queue their parts' results
come back on, and a bulk job's input and result files."""
