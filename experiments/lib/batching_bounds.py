"""What continuous batching can win over static on a workload: the bounds compare_batching prints.

`static_bound` and `fcfs_bound` count decode steps (every step costs the same, as on a
GPU); `machine_bound` prices each step of the same FCFS schedules at what a step of that
many sequences took on this machine, and says how near the CPU's roofline those steps ran
(experiments/lib/cpu_roofline.py).
"""

from __future__ import annotations

from experiments.lib.cpu_roofline import CpuRoofline, kv_bytes_per_token

_ROOFLINES: dict = {}


def batch_longest(budgets: list[int], batch: int) -> list[int]:
    """The longest budget of each static batch (FCFS batches of `batch`): its decode steps."""
    return [max(budgets[i:i + batch]) for i in range(0, len(budgets), batch)]


def static_bound(budgets: list[int], batch: int) -> float:
    """Continuous/static throughput bound at equal slots for these budgets if continuous
    wasted no slot-step at all (FCFS batches for static)."""
    import numpy as np

    longest = batch_longest(budgets, batch)
    sizes = [len(budgets[i:i + batch]) for i in range(0, len(budgets), batch)]
    # Static spends sum(longest * size) slot-steps for sum(budgets) useful tokens.
    return float(np.dot(longest, sizes) / np.sum(budgets))


def fcfs_bound(budgets: list[int], slots: int) -> float:
    """Static's decode steps over continuous's for these budgets in arrival order: static runs
    batches of `slots` to their longest member; continuous gives each request, in order, the
    slot that frees first, and ends when its last slot does. With few waves that tail can cost
    continuous all it saved (every wave's longest request at the cap): the ratio a run can reach."""
    import heapq

    static = sum(batch_longest(budgets, slots))
    free = [0] * slots
    end = 0
    for b in budgets:
        start = heapq.heappop(free)
        heapq.heappush(free, start + b)
        end = max(end, start + b)
    return static / end


def fcfs_rows(budgets: list[int], slots: int, static: bool) -> list[int]:
    """The decode steps of the FCFS schedules of `fcfs_bound`, as the number of sequences each
    step decodes: static's batches of `slots` run to their longest member (rows leave as they
    finish); continuous gives each request, in order, the slot that frees first."""
    import heapq

    steps: list[int] = []
    if static:
        for i in range(0, len(budgets), slots):
            batch = budgets[i:i + slots]
            steps += [sum(b > t for b in batch) for t in range(max(batch))]
        return steps
    free = [0] * slots
    ends = []
    for b in budgets:
        start = heapq.heappop(free)
        heapq.heappush(free, start + b)
        ends.append((start, start + b))
    length = max(e for _, e in ends)
    busy = [0] * (length + 1)
    for start, end in ends:
        busy[start] += 1
        busy[end] -= 1
    running = 0
    for t in range(length):
        running += busy[t]
        steps.append(running)
    return steps


def engine_roofline(llm, read_bytes: int) -> CpuRoofline | None:
    """The CPU roofline of `llm`'s model at its token buckets (measured once a run), None off the CPU."""
    import jax

    from cbjax.experimental import quant

    if jax.default_backend() != "cpu":
        return None
    key = (id(llm.model), tuple(llm.engine_info.token_buckets))
    if key not in _ROOFLINES:
        _ROOFLINES[key] = CpuRoofline(llm.model.config, quant.weight_bytes(llm.model.params), key[1],
                                      "int8" if llm.args.quantization == "int8" else "f32", read_bytes)
    return _ROOFLINES[key]


def machine_bound(static_llm, prompts, samplings, budgets: list[int], slots: int, max_gen: int,
                  roofline: CpuRoofline | None = None) -> dict:
    """This machine's continuous/static bound: the FCFS schedules of `fcfs_bound`, each decode
    step priced at what a decode step of its token bucket took in the static row's rounds
    (profiled once more, untimed, host/device overlap off: static decodes every batch size
    from full to one as its batches drain), the prompts' prefill priced alike for both.
    Continuous may reach it by refilling freed slots at once with the refills merged into the
    decode steps; it cannot beat it by much. With a `CpuRoofline` (its batches: the token
    buckets), each bucket's step against its floor at the workload's mean context."""
    import numpy as np
    from tqdm.auto import tqdm

    from cbjax.experimental import profile_rounds

    with tqdm(total=1, desc=f"static gen<={max_gen} profiled") as bar:
        rounds = profile_rounds(static_llm, list(zip(prompts, samplings)))
        bar.update()
    # A decode step costs what its token bucket costs (the rows pad up to it: 17 rows cost
    # twice 16 on a CPU): the median of static's decode rounds in each bucket, interpolated
    # between buckets for one static never ran alone.
    buckets = list(static_llm.engine_info.token_buckets)
    bucket = lambda rows: next((b for b in buckets if b >= rows), buckets[-1])  # noqa: E731
    by_bucket: dict[int, list[float]] = {}
    prefill, prefill_decodes = 0.0, []
    for calls, seconds in rounds:
        decoded = max((c.rows for c in calls if c.kind == "decode"), default=0)
        if all(c.kind == "decode" for c in calls):
            by_bucket.setdefault(bucket(decoded), []).append(seconds)
        else:  # prompt calls, and the round's decode (charged back below)
            prefill += seconds
            prefill_decodes += [decoded] if decoded else []
    sizes = sorted(by_bucket)
    step = [float(np.median(by_bucket[b])) for b in sizes]

    def cost(schedule: list[int]) -> float:
        return float(np.sum(np.interp([bucket(r) for r in schedule], sizes, step)))

    static_steps, continuous_steps = fcfs_rows(budgets, slots, True), fcfs_rows(budgets, slots, False)
    prefill = max(prefill - cost(prefill_decodes), 0.0)
    static_s, continuous_s = prefill + cost(static_steps), prefill + cost(continuous_steps)
    out = {"machine_bound_continuous_over_static": static_s / continuous_s,
           "machine_step_seconds": dict(zip(sizes, step)), "machine_prefill_seconds": prefill,
           "machine_schedule_seconds": {"static": static_s, "continuous": continuous_s}}
    if roofline is not None:
        context = float(np.mean([len(p) for p in prompts])) + float(np.mean(budgets)) / 2
        per_token = kv_bytes_per_token(static_llm.model.config, static_llm.args.kv_cache_dtype, static_llm.args.dtype)
        floors = {rows: roofline.floor_ms(rows, rows * context * per_token) for rows in sizes}
        out["machine_step_of_roofline"] = {
            rows: {"ms": 1e3 * seconds, "floor": floors[rows], "share": floors[rows]["ms"] / (1e3 * seconds)}
            for rows, seconds in zip(sizes, step)}
    return out


def roofline_table(columns: list[dict]) -> str:
    """Static's decode steps per token bucket against the CPU roofline, per column ("" without one)."""
    from experiments.lib.cpu_roofline import share_text

    measured = [c for c in columns if "machine_step_of_roofline" in c]
    if not measured:
        return ""
    lines = ["", "static's decode steps against this CPU's roofline (m: memory-bound floor, c: compute-bound)",
             f"{'column':>12} | {'rows':>4} | {'ms/step':>8} | {'tok/s':>7} | {'floor ms':>8} | of roofline"]
    for c in measured:
        for rows, s in sorted(c["machine_step_of_roofline"].items()):
            lines.append(f"{'gen<=' + str(c['max_gen_len']):>12} | {rows:>4} | {s['ms']:>8.1f} | "
                         f"{1e3 * rows / s['ms']:>7.1f} | {s['floor']['ms']:>8.1f} | "
                         f"{share_text(s['share'])} {s['floor']['bound'][0]}")
    lines.append(next(iter(_ROOFLINES.values())).describe() if _ROOFLINES else "")
    return "\n".join(lines)
