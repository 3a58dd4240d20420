"""External mode: ranks started by torchrun or srun, each running the same pytest session.

Every rank runs the same tests in the same order. For a test at world size W the first W ranks run
the body (on a sub-group when W is smaller than the launched world), then all ranks exchange their
results over a separate gloo control group (the poll of shardcheck/harness/waiting.py: all results arrive at
once) so that the verdict is the same everywhere; only rank 0 reports it (the other ranks' terminals
stay quiet, see the plugin). The launcher, not the harness, bounds the time a body may take.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from shardcheck.harness.context import RankContext
from shardcheck.harness.devices import device_for
from shardcheck.harness.launcher import LaunchEnv
from shardcheck.harness.isolation import Baseline, Settings, settle
from shardcheck.harness.ledger import CollectiveLedger, blame_unmatched
from shardcheck.harness.task import RankResult, Task, execute, reset_process_state
from shardcheck.harness.waiting import wait_for_ranks


class ExternalWorld:
    def __init__(self, launch: LaunchEnv, backend: str, timeout_s: float):
        self.launch, self.backend = launch, backend
        if launch.launcher == "srun":
            os.environ.setdefault("RANK", str(launch.rank))
            os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.groups: dict[int, object] = {}
        self.meshes: dict = {}
        self.ledger = CollectiveLedger()  # its wrappers are part of the baseline
        self.settings, self.before = Settings.capture(), Baseline.take()

    def _group(self, world_size: int):
        if world_size == self.launch.world_size:
            return None
        if world_size not in self.groups:  # every rank must create every group, in the same order
            self.groups[world_size] = dist.new_group(list(range(world_size)))
        return self.groups[world_size]

    def run(self, task: Task, world_size: int) -> list[RankResult]:
        def poll(pending: set[int], wait_s: float) -> dict[int, RankResult]:
            return dict(enumerate(self._exchange(task, world_size)))

        results, _ = wait_for_ranks(world_size, float("inf"), poll)
        # Unmatched collectives fail the test that left them; a launcher's ranks cannot be retired,
        # so the tests after it may still meet them.
        blame_unmatched(results)
        return [results[r] for r in range(world_size)]

    def _exchange(self, task: Task, world_size: int) -> list[RankResult]:
        """Run the body on the first `world_size` ranks; every rank's result, on every rank."""
        rank = self.launch.rank
        group = self._group(world_size)
        if rank < world_size:
            reset_process_state(task.seed)
            ctx = RankContext(rank=rank, world_size=world_size, backend=self.backend,
                              device=device_for(self.backend, self.launch.local_rank), mode="external",
                              group=group, _meshes=self.meshes.setdefault(world_size, {}))
            mine = execute(task, ctx)
            settle(mine, self.before, self.ledger)
            self.settings.restore()
        else:
            mine = RankResult(rank, "passed", "idle: outside this test's world")
        everyone: list = [None] * self.launch.world_size
        dist.all_gather_object(everyone, mine, group=self.control)
        return everyone[:world_size]
