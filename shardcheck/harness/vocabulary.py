"""The harness's words, each list defined once: backends, modes, and a rank's or a test's outcomes.

Backends (`--shardcheck-backend`, `@distributed(backend=)`):

    gloo      CPU processes
    nccl      CUDA processes, one device per rank
    threaded  ranks as threads of one process (torch's threaded process group)

Modes, how the ranks of a test are started (`shardcheck.harness.plan.choose_mode` picks one per test):

    pool      persistent rank processes, reused test after test (`--shardcheck-launch pool`, the default)
    spawn     fresh rank processes for every test (`--shardcheck-launch spawn`)
    thread    ranks as threads: the mode of the `threaded` backend, and its only one
    external  ranks started by torchrun or srun, each running the same pytest session

Outcomes, of one rank (`RankResult.outcome`) and of a whole test (`Verdict.outcome`); the
conformance suite has a richer vocabulary of its own (shardcheck/conformance/protocol/outcomes.py):

    passed    the body returned
    failed    it raised, the rank died, or it did not finish within the deadline
    skipped   the body (or the machine: backend, devices) skipped it
"""

BACKENDS = ("gloo", "nccl", "threaded")
MODES = ("pool", "spawn", "thread", "external")
LAUNCHES = ("pool", "spawn")  # the modes `--shardcheck-launch` chooses between: rank processes started here
OUTCOMES = ("passed", "failed", "skipped")
