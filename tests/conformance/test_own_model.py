"""The user's own model in the family models (shardcheck/conformance/checks/support/own_model.py):
its units, its drawn batches, bad input in one line, and `shardcheck run --model` from a project's
folder on a model shardcheck has never seen."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

import warm_python
from shardcheck.conformance.checks.support import own_model
from shardcheck.conformance.checks.support.own_model import OwnModel, OwnModelError, units_of

PROJECT = '''
import torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12))

    def forward(self, x):
        return x + self.ff(x)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(12, 37)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

def build():
    return Net()

def broken():
    raise RuntimeError("no config file")

def nothing():
    return nn.ReLU()
'''


def test_the_name_travels_as_one_string():
    own = OwnModel("pkg.m:build", "pkg.m:batch", ("Block", "Head"))
    assert str(own) == "pkg.m:build|batches=pkg.m:batch|wrap=Block,Head"
    assert OwnModel.parse(str(own)) == own and OwnModel.parse("pkg.m:build") == OwnModel("pkg.m:build")


def test_units_are_the_named_classes_the_declared_layers_or_the_repeated_block():
    tower = nn.Sequential(nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert units_of(tower) == ("1.0", "1.1")  # the repeated class of the shallowest container...
    wrapped = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Sequential(nn.Linear(2, 2), nn.ReLU())})
    assert units_of(wrapped, ("Sequential",)) == ("b",)  # ...or the classes named
    wrapped._no_split_modules = ["Linear"]  # as transformers declares its decoder layers
    assert units_of(wrapped) == ("a", "b.0")
    with pytest.raises(OwnModelError, match=r"wrap class Blok matches no module of the model \(its classes: "):
        units_of(wrapped, ("Blok",))


def test_batches_are_drawn_from_the_first_module(monkeypatch):
    class Ctx:
        rank, device = 1, torch.device("cpu")

        def seeded(self, seed):
            torch.manual_seed(seed)
            return torch.no_grad()

    monkeypatch.setattr(own_model, "build", lambda own: nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 9)))
    w = own_model.workload("x:y")
    ids, targets = w.batches(Ctx(), 2)[1]
    assert ids.shape == (own_model.BATCH, own_model.SEQ) and ids.max() < 9 and targets is None
    loss = w.loss_fn(w.build(), (ids, targets))  # the next token of the same sequence
    assert loss.ndim == 0 and loss.item() > 0
    monkeypatch.setattr(own_model, "build", lambda own: nn.Sequential(nn.Conv2d(3, 2, 3)))
    (x, target), = own_model.workload("x:y").batches(Ctx(), 1)
    assert x.shape == (own_model.BATCH, 3, own_model.IMAGE, own_model.IMAGE) and target.numel() == 0
    monkeypatch.setattr(own_model, "build", lambda own: nn.Sequential(nn.LSTM(3, 3)))
    with pytest.raises(OwnModelError, match="first module is a LSTM: give its batches"):
        own_model.workload("x:y")


@pytest.fixture
def project(tmp_path):
    (tmp_path / "their_models.py").write_text(PROJECT)
    return tmp_path


def _run(project, *args):
    return warm_python.run(["-m", "shardcheck.conformance.cli", "run", *args], cwd=project,
                           env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}, timeout=300)


@pytest.mark.parametrize("args, says", [
    (("--model", "their_models:broken"), "their_models:broken() raised RuntimeError: no config file"),
    (("--model", "their_models:nothing"), "returned a ReLU without parameters: nothing to shard"),
    (("--model", "their_modelz:build"), "cannot import their_modelz:build: ModuleNotFoundError"),
    (("--model", "their_models:build", "--wrap", "Blok"), "wrap class Blok matches no module"),
    (("--wrap", "Block"), "--batches and --wrap describe a --model"),
])
def test_bad_input_is_one_line_and_the_usage_status(project, args, says):
    done = _run(project, *args, "-o", str(project / "r.json"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (project / "r.json").exists()


def test_a_model_shardcheck_never_saw_is_judged_from_its_folder(project):
    done = _run(project, "--model", "their_models:build", "--impl", "torch-fsdp2", "--world-sizes", "2",
                "-k", "FULL_SHARD", "-o", str(project / "r.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((project / "r.json").read_text())
    rows = [dict(zip(report["cell_columns"], row)) for row in report["cells"]]
    assert len(rows) == 1 and rows[0]["outcome"] == "passed", rows
    assert "their_models:build" in json.dumps(report["cases"])
