"""Property-based differential checks: `shardcheck explore` and the family `explore`.

Hypothesis draws whole training configurations off the fixed grid of the other checks, each runs on
the persistent rank pool against unsharded data-parallel training (the behaviour layer's oracle,
checks/support/parity.train_in_parity), and a new failure is shrunk to a minimal configuration.

    config.py      the drawn configuration: a frozen dataclass, its JSON form, its named facts
    strategies.py  hypothesis strategies, limited by the adapter's declared capabilities
    model.py       what a rank builds from a configuration: model, ShardSpec, Recipe, batches
    run.py         one example: the rank body, `shardcheck.harness.run` in the parent, the outcome and signature
    search.py      the search: rounds of hypothesis, known findings skipped, shrinking, limits
    findings.py    new findings, replay files, and the manifests' `[[explore]]` entries (known ones)

The command line is shardcheck/conformance/cli/explore.py; the pytest family
shardcheck/conformance/checks/behaviour/test_explore.py.
"""

import importlib.util

# hypothesis is the extra `explore` (it brings a pytest plugin of its own into every session).
MISSING = "explore draws configurations with hypothesis, which is not installed: pip install 'shardcheck[explore]'"


def available() -> bool:
    """Whether hypothesis can be imported (search.py and strategies.py need it)."""
    return importlib.util.find_spec("hypothesis") is not None
