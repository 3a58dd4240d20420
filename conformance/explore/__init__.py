"""Property-based differential checks: `shardcheck explore` and the family `explore`.

Hypothesis draws whole training configurations off the fixed grid of the other checks, each runs on
the persistent rank pool against unsharded data-parallel training (the behaviour layer's oracle,
checks/support/parity.train_in_parity), and a new failure is shrunk to a minimal configuration.

    config.py      the drawn configuration: a frozen dataclass, its JSON form, its named facts
    strategies.py  hypothesis strategies, limited by the adapter's declared capabilities
    model.py       what a rank builds from a configuration: model, ShardSpec, Recipe, batches
    run.py         one example: the rank body, `harness.run` in the parent, the outcome and signature
    search.py      the search: rounds of hypothesis, known findings skipped, shrinking, limits
    findings.py    new findings, replay files, and the manifests' `[[explore]]` entries (known ones)

The command line is conformance/cli/explore.py; the pytest family
conformance/checks/behaviour/test_explore.py.
"""
