"""The studies: the seeds' questions (static vs continuous batching, latency under load,
capacity, the scheduler's knobs, disaggregation, the KV cache's host tier, the simulator),
each an absl script that prints its table and writes a JSON file and a plot."""
