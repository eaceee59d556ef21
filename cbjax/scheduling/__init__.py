"""Host-side scheduling, plain Python with no JAX: the `Scheduler` and its config, the
`Plan` of `Call`s of `Row`s it hands the executor and the `RoundResult` it records, the paged cache's `BlockManager` and the page
look-ahead (`PageReservations`)."""

from cbjax.scheduling.block_manager import BlockManager
from cbjax.scheduling.config import MERGE_MODES, ORDERINGS, POLICIES, SchedulerConfig
from cbjax.scheduling.plan import Call, CallResult, Plan, RoundResult, Row
from cbjax.scheduling.scheduler import Scheduler

__all__ = ["MERGE_MODES", "ORDERINGS", "POLICIES", "BlockManager", "Call", "CallResult", "Plan", "RoundResult", "Row",
           "Scheduler", "SchedulerConfig"]
