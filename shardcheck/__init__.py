"""shardcheck: a distributed test harness and conformance suite for sharded data parallel training.

    shardcheck.harness          run one test body on N ranks (pool, spawn, threads, torchrun/srun)
    shardcheck.reference_impl   the yardstick: a small, readable, correct sharding implementation
    shardcheck.conformance      checks against an adapter protocol, manifests, reports, simulation
    shardcheck.pytest_plugin    the one pytest entry point (`-p no:shardcheck` turns it off)

Importing this package imports nothing else (the pytest entry point lives in it).
"""
