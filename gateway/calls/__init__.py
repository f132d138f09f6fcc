"""A checked request on its way to its model, shared by the sync routes and jobs: the
model it names, its limits and deadline, the native API's request and response shapes,
and its large images offloaded to the blob store (claim checks)."""
