"""Property-based differential checks (family explore): hypothesis draws whole training
configurations off the fixed grid of the other families (world sizes 1 to 4, widths from 1, empty
and padded shards, tied, frozen and buffered blocks, a strategy per unit, HYBRID_SHARD on every 2-D
mesh, low-precision dtypes, every declared clip norm over six orders of magnitude, gradient
magnitudes, loss scaling with an inf or NaN on one rank at one step), limited to what the
implementation declares, and each trains like unsharded data-parallel training
(checks/support/parity.train_in_parity) step by step.

One cell per implementation, in the parent: a fixed seed and a fixed number of examples, so the cell
is deterministic and cheap (`shardcheck explore` runs the same search with a larger budget). The
implementation's known findings (`[[explore]]` entries of its manifest) do not fail it; a new failure
is shrunk to a minimal configuration and reported with its reproducer.
"""

from __future__ import annotations

import json

import pytest

from shardcheck.conformance import explore as exploring
from shardcheck.conformance.explore.config import to_json
from shardcheck.conformance.protocol import Unsupported
from shardcheck.harness.launcher import detect

SEED = 0
EXAMPLES = 24       # examples per cell (shrinking included): a few seconds per implementation
BUDGET_S = 60.0     # a safety stop; EXAMPLES ends the cell first on a quiet machine
SHRINK = 8


def limits(config):
    """The cell's limits: the session's first backend, its --shardcheck-world-sizes (else 1 to 4)."""
    from shardcheck.conformance.explore.search import Limits

    backend = config.getoption("shardcheck_backend").split(",")[0].strip()
    sizes = config.getoption("shardcheck_world_sizes")
    kept = tuple(int(s) for s in sizes.split(",")) if sizes else (1, 2, 3, 4)
    return Limits(max_examples=EXAMPLES, budget_s=BUDGET_S, shrink_examples=SHRINK, world_sizes=kept,
                  backend=backend)


def test_explore(request, impl):
    """No drawn configuration makes `impl` differ from unsharded data-parallel training, except
    the known findings of its manifest."""
    if detect() is not None:
        pytest.skip("explore drives its own ranks; not under an external launcher")
    if not exploring.available():
        pytest.skip(exploring.MISSING)  # this machine's, not the implementation's
    from shardcheck.conformance.explore.search import explore

    result = explore(impl, SEED, limits(request.config))
    summary = {"impl": result.impl, "seed": SEED, "examples": result.examples, "passed": result.passed,
               "unsupported": result.unsupported, "failed": result.failed, "seconds": round(result.seconds, 2),
               "known": {k: v["count"] for k, v in result.known.items()},
               "findings": [f.to_json() for f in result.findings]}
    request.node.user_properties.append(("explore", summary))
    if 0 < result.examples == result.unsupported:  # no verdict reached: unsupported, never a pass
        raise Unsupported(f"{impl.name} refused every drawn configuration ({result.examples} of them) here")
    assert result.examples > result.unsupported, f"{impl.name}: no configuration was drawn"
    assert result.ok, "\n".join(
        f"{impl.name}: new finding {f.signature}\n  config: {json.dumps(to_json(f.config), sort_keys=True)}\n"
        f"  reproduce: save the config as a finding file and run shardcheck explore --replay FILE, or "
        f"shardcheck explore --impl {impl.name} --seed {SEED} --examples {EXAMPLES}\n{f.message}"
        for f in result.findings)
