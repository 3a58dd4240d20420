"""`shardcheck cells`: the cells a declaration reaches, per family and strategy, what each undeclared
capability would add, and what is declared in vain; collected, never run."""

from __future__ import annotations

import re

import warm_python
from shardcheck.conformance.cli import exit_codes as codes

ZERO1 = """
from shardcheck.conformance.examples.allreduce_engine import AllReduceAdapter


class Adapter(AllReduceAdapter):  # a ZeRO-1 author's first declaration
    name = "mine"
    capabilities = frozenset({"shard_optimizer", "clip_norm_2", "activation_checkpointing"})
"""


def _cells(tmp_path, *args):
    (tmp_path / "zero1.py").write_text(ZERO1)
    return warm_python.run(["-m", "shardcheck.conformance.cli", "cells", *args], cwd=tmp_path, timeout=300)


def test_cells_per_family_and_strategy_and_what_each_capability_adds(tmp_path):
    proc = _cells(tmp_path, "--impl", "zero1:Adapter", "--family", "sharding,composition")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # sharding: 13 cells (4 strategies at 1, 2, 4 ranks and the hybrid one); SHARD_OPTIMIZER's 3 reached
    assert re.search(r"^sharding\s+13\s+3\s+SHARD_OPTIMIZER 3$", out, re.M), out
    assert re.search(r"^composition\s+\d+\s+0\s*$", out, re.M), out  # its cells need other strategies or more
    assert re.search(r"^  no_shard\s+\+3$", out, re.M) and re.search(r"^  hybrid_shard\s+\+1$", out, re.M), out
    assert "mine: 3 of " in out
    # activation_checkpointing's cells all need FULL_SHARD or SHARD_GRAD_OP: declared in vain
    assert re.search(r"declared, reaching no cell.*\n  activation_checkpointing, clip_norm_2$", out, re.M), out


def test_cells_world_sizes_and_a_builtin(tmp_path):
    proc = _cells(tmp_path, "--impl", "torch-zero", "--family", "sharding", "--world-sizes", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^sharding\s+4\s+1\s+SHARD_OPTIMIZER 1$", proc.stdout, re.M), proc.stdout


def test_cells_of_an_unknown_name_is_one_line(tmp_path):
    for args, code in ((["--impl", "nope"], codes.UNKNOWN_NAME), (["--impl", "ddp", "--family", "nope"], codes.UNKNOWN_NAME)):
        proc = _cells(tmp_path, *args)
        assert proc.returncode == code and len(proc.stderr.strip().splitlines()) == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
