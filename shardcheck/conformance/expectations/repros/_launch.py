"""What every reproduction in this folder shares: start N gloo ranks (fork, FileStore in a temp dir),
run `body(rank, world_size)` on each, collect what each rank did, and end with the verdict.

    results = run(body, world_size=2)          # {rank: "returned: ..." | "raised Type: msg" | "hung"}
    verdict(all("Cannot access" in r for r in results.values()), "what the finding says", results)

`verdict` prints every rank's result and `REPRODUCED: ...` (exit 0) or `NOT REPRODUCED: ...` (exit 1:
torch changed; revisit the finding and its manifest entry).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import tempfile
import time
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, body, world_size, folder, timeout_s):
    warnings.simplefilter("ignore")
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=dt.timedelta(seconds=timeout_s))
    open(os.path.join(folder, f"joined{rank}"), "w").close()
    try:
        result = f"returned: {body(rank, world_size)}"
    except Exception as exc:  # the failure under study
        result = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    with open(os.path.join(folder, f"rank{rank}"), "w") as f:
        f.write(result)
    # No rank leaves while another is still joining the group (CI saw a quick rank's exit break the
    # other's init). Not a barrier on the group: a rank the failure under study left inside a
    # collective would hold it until the gloo timeout (F9's reproduction did).
    deadline = time.monotonic() + timeout_s
    while (not all(os.path.exists(os.path.join(folder, f"joined{r}")) for r in range(world_size))
           and time.monotonic() < deadline):
        time.sleep(0.01)
    dist.destroy_process_group()


def run(body, world_size: int = 2, timeout_s: float = 30.0) -> dict[int, str]:
    """Each rank's result; "hung" for a rank still running after `timeout_s` or dead without one."""
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_rank, args=(body, world_size, folder, timeout_s), nprocs=world_size,
                                 join=False, start_method="fork")
        # Past the gloo timeout, twice, and the ranks' start: a blocked rank raises first, also on a
        # loaded machine (with `+ timeout_s + 5` F11's repro saw both ranks "hung" there).
        deadline = time.monotonic() + 2 * timeout_s + 10
        # Each rank is waited for on its own: ProcessContext.join terminates every other rank as soon as
        # one exits non-zero, which could kill a rank before it wrote its result (seen: "hung").
        while any(p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        results = {}
        for rank in range(world_size):
            path = os.path.join(folder, f"rank{rank}")
            results[rank] = open(path).read() if os.path.exists(path) else "hung"
        return results


def verdict(reproduced: bool, finding: str, results: dict[int, str]) -> None:
    for rank, result in sorted(results.items()):
        print(f"rank {rank}: {result}")
    print(f"{'REPRODUCED' if reproduced else 'NOT REPRODUCED'}: {finding}")
    sys.exit(0 if reproduced else 1)
