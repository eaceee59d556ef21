"""The experiments: the studies of the seeds' questions (`studies/`), the benchmarks
(`benchmarks/`) and their shared helpers (`lib/`). Run one from the repository's root:
`python -m experiments NAME [--flags]` (`python -m experiments` lists them)."""
