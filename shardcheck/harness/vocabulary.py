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

Each list is a `StrEnum` (a member is a `str` equal to its value: options, ids and records read the
same) and the tuple of its members.  What crosses to an xdist controller stays a plain string:
execnet, which carries its reports, serializes no enum.
"""

import enum


class Backend(enum.StrEnum):
    GLOO = "gloo"
    NCCL = "nccl"
    THREADED = "threaded"

    __repr__ = str.__repr__  # 'gloo', as the strings printed before


class Mode(enum.StrEnum):
    POOL = "pool"
    SPAWN = "spawn"
    THREAD = "thread"
    EXTERNAL = "external"

    __repr__ = str.__repr__


class RankOutcome(enum.StrEnum):
    """A rank's or a harness test's outcome (the conformance cell's richer one: protocol.outcomes.Outcome)."""
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"

    __repr__ = str.__repr__


BACKENDS = tuple(Backend)
MODES = tuple(Mode)
LAUNCHES = (Mode.POOL, Mode.SPAWN)  # the modes `--shardcheck-launch` chooses between: rank processes started here
OUTCOMES = tuple(RankOutcome)
