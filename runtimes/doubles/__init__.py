"""Stand-ins for a device or a model, for benchmarks and tests: the emulated GPU-class
device, faulty adapters, the simulated runtime. No product module imports them: they are
reached by module name (`runtimes.pytorch.device_double`, the registry's `sim` engine, the
test families' "module:Class" strings).
"""
