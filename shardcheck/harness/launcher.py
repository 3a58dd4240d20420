"""Which launcher, if any, started this process as a rank (torchrun, or srun when asked): read from
the environment alone, cheaply (the pytest plugin asks before anything imports torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class LaunchEnv:
    launcher: str  # torchrun | srun
    rank: int
    world_size: int
    local_rank: int


def detect() -> LaunchEnv | None:
    """torchrun is recognised from its variables; srun only when SHARDCHECK_LAUNCHER=srun says so
    (SLURM variables are also set inside a plain batch allocation)."""
    env = os.environ
    if env.get("SHARDCHECK_LAUNCHER", "") == "srun" and "SLURM_PROCID" in env:
        return LaunchEnv("srun", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)))
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                         int(env.get("LOCAL_RANK", 0)))
    return None
