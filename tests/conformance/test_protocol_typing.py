"""The trainer's optional methods as typing protocols (protocol/adapter.py): the one list both an
author's type checker and the load-time check (protocol/required.py) read, with shardcheck itself
still finding the methods by name."""

from __future__ import annotations

import pickle

import pytest

from shardcheck.conformance import protocol
from shardcheck.conformance.protocol import required
from shardcheck.conformance.protocol.adapter import methods_of


def test_the_protocols_declare_what_the_load_time_check_requires():
    assert methods_of(protocol.Trainer) == required.TRAINER == ("forward_backward", "full_grads", "step", "full_params")
    assert methods_of(protocol.CheckpointingTrainer) == required.CHECKPOINT_TRAINER == (
        "save", "load", "full_state_dict", "full_optimizer_state")
    assert methods_of(protocol.EvaluatingTrainer) == ("evaluate",)
    assert methods_of(protocol.FineTuningTrainer) == ("set_requires_grad",)
    assert methods_of(protocol.ClosingTrainer) == ("close",)
    for optional in (protocol.CheckpointingTrainer, protocol.EvaluatingTrainer, protocol.FineTuningTrainer,
                     protocol.ClosingTrainer):
        assert issubclass(optional, protocol.Trainer)


class _Steps:
    def forward_backward(self, batch): ...
    def full_grads(self): ...
    def step(self): ...
    def full_params(self): ...


class Derived(_Steps, protocol.CheckpointingTrainer):  # an author who derives from the protocol...
    def save(self, path): ...  # ...and forgets load, full_state_dict and full_optimizer_state


class Complete(_Steps):
    def save(self, path): ...
    def load(self, path): ...
    def full_state_dict(self): ...
    def full_optimizer_state(self): ...


def _adapter(trainer_class):
    class Adapter:
        name, version, capabilities = "mine", "0", frozenset({"no_shard", "checkpoint"})

        def trainer(self, model, spec, recipe) -> trainer_class: ...

    Adapter.trainer.__annotations__["return"] = trainer_class
    return Adapter()


def test_a_protocol_stub_a_trainer_inherits_is_no_implementation():
    assert required.missing(_adapter(Derived)) == ["Derived.load", "Derived.full_state_dict",
                                                   "Derived.full_optimizer_state"]
    assert required.missing(_adapter(Complete)) == []
    # naming a protocol instead of a class leaves the trainer to be met when a cell builds it
    assert required.missing(_adapter(protocol.CheckpointingTrainer)) == []


def test_the_torch_style_adapter_declares_its_api_to_the_type_checker_alone():
    """`name` and `shard` are annotations only: an adapter that lacks shard is still found lacking."""
    assert not hasattr(protocol.TorchStyleAdapter, "shard") and not hasattr(protocol.TorchStyleAdapter, "name")
    assert {"name", "shard"} <= set(protocol.TorchStyleAdapter.__annotations__)

    class NoShard(protocol.TorchStyleAdapter):
        name, version, capabilities = "mine", "0", frozenset({"no_shard"})

        def full_params(self, model): ...
        def full_grads(self, model): ...

    assert required.missing(NoShard()) == ["NoShard.shard"]


@pytest.mark.parametrize("name", ["CheckpointError", "HarnessUsageError", "ManifestError", "ReportError",
                                  "StreamError", "UnknownAdapter", "AdapterImportError", "PartsError"])
def test_errors_of_the_family_still_cross_processes_and_keep_their_builtin(name):
    """Raised on a rank and pickled to the parent, or caught as the builtin they always were."""
    from shardcheck.conformance import adapters
    from shardcheck.conformance.cli import exit_codes as codes
    from shardcheck.conformance.expectations import manifest
    from shardcheck.conformance.report import merge, reading, stream
    from shardcheck.errors import ShardcheckError
    from shardcheck.harness import plan
    from shardcheck.reference_impl import checkpoint

    homes = {"CheckpointError": (checkpoint, ValueError, codes.FAILED), "HarnessUsageError": (plan, ValueError, codes.USAGE),
             "ManifestError": (manifest, ValueError, codes.USAGE), "ReportError": (reading, Exception, codes.USAGE),
             "StreamError": (stream, ValueError, codes.USAGE), "UnknownAdapter": (adapters, LookupError, codes.UNKNOWN_NAME),
             "AdapterImportError": (adapters, LookupError, codes.ADAPTER_IMPORT),
             "PartsError": (merge, Exception, codes.PARTS)}
    module, builtin, status = homes[name]
    cls = getattr(module, name)
    error = pickle.loads(pickle.dumps(cls("one line")))
    assert type(error) is cls and str(error) == "one line"
    assert isinstance(error, ShardcheckError) and isinstance(error, builtin)
    assert error.exit_status == status
