"""A `jax.profiler` trace summarised for a benchmark's JSON: what the device did.

The trace JSON (`*.trace.json.gz`, written beside the xplane by `jax.profiler.trace`) holds
Chrome trace events; a GPU's or TPU's are under a process named `/device:...`. No flags and
no JAX here, so a test can read a trace it made.
"""

from __future__ import annotations

import glob
import gzip
import json
import os


def summarise_trace(trace_dir: str, top: int = 12) -> dict:
    """The trace's device events (a process named like a GPU or TPU): busy time, idle share of
    the span they cover, time per kernel name, and device-to-host copies."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": "no trace written"}
    events = json.load(gzip.open(files[0]))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if "/device:" in n and "CPU" not in n}
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e["pid"] in device and e.get("dur", 0) > 0)
    if not spans:
        return {"device_events": 0, "processes": sorted(names.values())}
    busy, end, by_name, syncs = 0.0, spans[0][0], {}, 0
    for start, stop, name in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        by_name[name] = by_name.get(name, 0.0) + (stop - start)
        syncs += "DtoH" in name or "Device to Host" in name or "MemcpyD2H" in name
    wall = end - spans[0][0]
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"device_events": len(spans), "busy_us": busy, "wall_us": wall, "idle_share": 1 - busy / wall,
            "device_to_host_copies": syncs, "top_kernels_us": [[n[:90], t] for n, t in kernels]}
