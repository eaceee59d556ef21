"""One engine over several devices: tensor parallelism (sharding.py), expert parallelism
(expert_parallel.py) and pipeline stages (pipeline.py)."""
