"""Single-process checks of the ported models and the TwoTensor subclass."""

import copy

import pytest
import torch
import torch.nn as nn

from shardcheck.conformance.checks.support import models as M

# nn.Transformer (inside TransformerWithSharedParams) warns about nested tensors,
# exactly like torch's original model; it is irrelevant here.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _trainable_grads_present(model):
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert p.grad.shape == p.shape, name
        else:
            assert p.grad is None, name


# ---------------------------------------------------------------- builders

BUILDERS = {
    "twsp": lambda: M.TransformerWithSharedParams(deterministic=True),
    "twsp_no_bn": lambda: M.TransformerWithSharedParams(deterministic=True, add_bn=False),
    "nested": lambda: M.NestedWrappedModule(deterministic=True),
    "nonuniform": lambda: M.NonUniformReqGradNWM(deterministic=True),
    "net": lambda: M.Net(has_wrapping=False),
    "net_wrapped": lambda: M.Net(has_wrapping=True),
}


def _seeded(build, seed=42):
    def f():
        torch.manual_seed(seed)
        return build()

    return f


SEEDED_RAW = {
    "mlp": lambda: M.MLP(8, with_buffer=True),
    "mlp_stack": lambda: M.MLPStack(16),
    "mlp_stack_sp": lambda: M.MLPStack(16, with_seq_parallel=True),
    "transformer": lambda: M.Transformer(M.ModelArgs(dropout_p=0.0)),
    "transformer_experts": lambda: M.Transformer(M.ModelArgs(num_experts=2)),
    "two_linear": M.TwoLinear,
}
SEEDED_BUILDERS = {k: _seeded(v) for k, v in SEEDED_RAW.items()}
ALL_BUILDERS = {**BUILDERS, **SEEDED_BUILDERS}


@pytest.mark.parametrize("name", sorted(ALL_BUILDERS))
def test_same_seed_same_params(name):
    build = ALL_BUILDERS[name]
    a, b = build(), build()
    _assert_same_state(a, b)
    assert [p.requires_grad for p in a.parameters()] == [p.requires_grad for p in b.parameters()]


@pytest.mark.parametrize("name", sorted(SEEDED_RAW))
def test_different_seed_different_params(name):
    a = _seeded(SEEDED_RAW[name], 42)()
    b = _seeded(SEEDED_RAW[name], 7)()
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_deterministic_models_ignore_ambient_seed():
    torch.manual_seed(1)
    a = M.NestedWrappedModule(deterministic=True)
    torch.manual_seed(2)
    b = M.NestedWrappedModule(deterministic=True)
    _assert_same_state(a, b)
    torch.manual_seed(1)
    c = M.NestedWrappedModule(deterministic=False)
    torch.manual_seed(2)
    d = M.NestedWrappedModule(deterministic=False)
    assert not torch.equal(c.module[0].weight, d.module[0].weight)


# ------------------------------------------------- forward / backward shapes


def test_transformer_with_shared_params_fwd_bwd():
    model = M.TransformerWithSharedParams(rank=0, world_size=2, deterministic=True)
    assert not model.training  # deterministic => eval(), as in torch
    src, tgt = model.get_input("cpu")
    assert src.shape == (6, 2) and tgt.shape == (4, 2)
    out = model(src, tgt)
    assert out.shape == (4, 2, M.TransformerWithSharedParams.D_VOCAB)
    loss = model.get_loss((src, tgt), out)
    assert loss.ndim == 0 and loss.dtype == torch.float32
    expected = nn.functional.cross_entropy(out.view(-1, 23), tgt.view(-1), reduction="sum")
    assert torch.equal(loss, expected)
    model.run_backward(loss)
    _trainable_grads_present(model)
    names = {n for n, _ in model.named_buffers()}
    assert {"vocab_bias", "long_buffer"} <= names
    assert model.long_buffer.dtype == torch.long


def test_transformer_with_shared_params_input_depends_on_rank_only():
    m0 = M.TransformerWithSharedParams(rank=0)
    m1 = M.TransformerWithSharedParams(rank=1)
    for a, b in zip(m0.get_input("cpu"), m1.get_input("cpu")):
        assert torch.equal(a, b)  # arange inputs
    # get_input reseeds with 1 + rank, so the RNG state afterwards is rank dependent
    m0.get_input("cpu")
    r0 = torch.rand(3)
    m1.get_input("cpu")
    r1 = torch.rand(3)
    assert not torch.equal(r0, r1)


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_from_group():
    m = M.TransformerWithSharedParams.from_group(_Group(1, 4), add_bn=False)
    assert (m.rank, m.world_size) == (1, 4)
    assert isinstance(m.bn, nn.Identity)
    n = M.NestedWrappedModule.from_group(_Group(3, 4))
    assert (n.rank, n.world_size) == (3, 4)


@pytest.mark.parametrize("cls", [M.NestedWrappedModule, M.NonUniformReqGradNWM])
def test_nested_wrapped_module_fwd_bwd(cls):
    model = cls(rank=1, world_size=2, deterministic=True)
    (x,) = model.get_input("cpu")
    assert x.shape == (4, 8)
    (x_again,) = model.get_input("cpu")
    assert torch.equal(x, x_again)
    out = model(x)
    assert out.shape == (4, 8)
    loss = model.get_loss((x,), out)
    assert torch.equal(loss, out.sum())
    model.run_backward(loss)
    _trainable_grads_present(model)


def test_nested_wrapped_module_layout():
    m = M.NestedWrappedModule()
    shapes = [tuple(p.shape) for p in m.parameters()]
    assert shapes == [(4, 8), (4,), (16, 4), (16,), (16, 16), (16,), (4, 16), (4,), (8, 4), (8,)]
    assert isinstance(m.module[1], nn.Sequential)


def test_nonuniform_req_grad():
    m = M.NonUniformReqGradNWM(deterministic=True)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable == ["module.2.1.weight", "module.2.1.bias"]
    unfrozen = M.NonUniformReqGradNWM(deterministic=True, freeze=False)
    assert all(p.requires_grad for p in unfrozen.parameters())
    _assert_same_state(m, unfrozen)

    # The pattern must also match names with FSDP1's interstitial module name.
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._fsdp_wrapped_module = inner

    outer = nn.Module()
    outer.module = nn.Sequential(
        nn.Linear(8, 4), nn.Linear(4, 4), Wrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    )
    M.NonUniformReqGradNWM.set_nonuniform_req_grad(outer)
    trainable = [n for n, p in outer.named_parameters() if p.requires_grad]
    assert trainable == [
        "module.2._fsdp_wrapped_module.1.weight",
        "module.2._fsdp_wrapped_module.1.bias",
    ]


@pytest.mark.parametrize("with_buffer", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_fwd_bwd(with_buffer, bias):
    m = M.MLP(8, bias=bias, with_buffer=with_buffer)
    assert m.in_proj.weight.shape == (32, 8) and m.out_proj.weight.shape == (8, 32)
    assert (m.in_proj.bias is not None) == bias
    assert (m.buffer is not None) == with_buffer
    x = torch.randn(2, 8)
    out = m(x)
    assert out.shape == (2, 8)
    if not with_buffer:
        assert (out >= 0).all()
    out.sum().backward()
    _trainable_grads_present(m)
    m.reset_parameters()


def test_mlp_meta_device():
    with torch.device("meta"):
        m = M.MLP(8, bias=False)
    assert all(p.device.type == "meta" for p in m.parameters())
    m.to_empty(device="cpu")
    assert m(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.parametrize("with_seq_parallel", [False, True])
def test_mlp_stack(with_seq_parallel):
    m = M.MLPStack(16, with_seq_parallel=with_seq_parallel)
    assert len(m) == (4 if with_seq_parallel else 3)
    assert m[0].in_proj.weight.shape == (48, 16)  # multiplier 3 -> uneven
    assert m[1].in_proj.weight.shape == (64, 16)
    assert m[2].in_proj.weight.shape == (48, 16)
    if with_seq_parallel:
        assert isinstance(m[3], nn.LayerNorm) and m[3].bias is None
    x = torch.randn(2, 16)
    out = m(x)
    assert out.shape == (2, 16)
    out.sum().backward()
    _trainable_grads_present(m)
    plan = m.tp_plan()
    for path in plan:
        m.get_submodule(path)
    assert plan["0.in_proj"] == M.TPStyle("colwise", use_local_output=False)
    if with_seq_parallel:
        assert plan["2.out_proj"].output_shard_dim == 1
        assert plan["3"] == M.TPStyle("sequence", sequence_dim=1)
    else:
        assert plan["2.out_proj"] == M.TPStyle("rowwise")
        assert "3" not in plan


@pytest.mark.parametrize("num_experts", [0, 2])
def test_transformer_fwd_bwd(num_experts):
    torch.manual_seed(42)
    args = M.ModelArgs(dropout_p=0.0, num_experts=num_experts)
    m = M.Transformer(args)
    inp = torch.randint(0, args.vocab_size, (3, 16))
    out = m(inp)
    assert out.shape == (3, 16, args.vocab_size) and out.dtype == torch.float32
    out.sum().backward()
    _trainable_grads_present(m)
    blocks = [mod for mod in m.modules() if isinstance(mod, M.TransformerBlock)]
    assert len(blocks) == args.n_layers
    with pytest.raises(AssertionError):
        m(torch.randint(0, args.vocab_size, (1, args.max_seq_len + 1)))


def test_transformer_checkpoint_activations_matches():
    torch.manual_seed(0)
    a = M.Transformer(M.ModelArgs(dropout_p=0.0))
    b = copy.deepcopy(a)
    b.checkpoint_activations = True
    inp = torch.randint(0, 8, (2, 8))
    a(inp).sum().backward()
    b(inp).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


@pytest.mark.parametrize("has_wrapping", [False, True])
def test_net(has_wrapping):
    m = M.Net(has_wrapping=has_wrapping)
    _assert_same_state(m, M.Net(has_wrapping=not has_wrapping))  # seeds 0 itself
    (x,) = m.get_input("cpu")
    assert x.shape == (16, 8)
    out = m(x)
    assert out.shape == (16, 4)
    m.get_loss((x,), out).backward()
    _trainable_grads_present(m)


def test_two_linear():
    m = M.TwoLinear()
    (x,) = m.get_input("cpu")
    assert m(x).shape == (2, 5)


# ------------------------------------------------------------ tied weights


def test_tied_weights():
    t = M.TransformerWithSharedParams(deterministic=True)
    assert t.output_proj.weight is t.embed_tokens.weight
    # named_parameters() de-duplicates the shared tensor
    names = [n for n, _ in t.named_parameters()]
    assert "embed_tokens.weight" in names and "output_proj.weight" not in names
    t2 = copy.deepcopy(t)
    assert t2.output_proj.weight is t2.embed_tokens.weight
    src, tgt = t.get_input("cpu")
    t.get_loss((src, tgt), t(src, tgt)).backward()
    assert t.embed_tokens.weight.grad is not None

    tr = M.Transformer(M.ModelArgs())
    assert tr.output.weight is tr.tok_embeddings.weight
    untied = M.Transformer(M.ModelArgs(weight_tying=False))
    assert untied.output.weight is not untied.tok_embeddings.weight
    for model in (t, tr):
        for owner, alias in type(model).TIED_PARAMS:
            assert model.get_parameter(owner) is model.get_parameter(alias)


# ----------------------------------------------------------- wrap specs


def test_resolve_units():
    t = M.TransformerWithSharedParams()
    assert M.resolve_units(t) == [
        ("transformer.encoder.layers.0", {}),
        ("transformer.encoder.layers.1", {}),
        ("transformer.decoder.layers.0", {}),
        ("transformer.decoder.layers.1", {}),
        ("", {}),
    ]
    assert M.resolve_units(t, "mixed_strategy") == [
        ("transformer.encoder", {"sharding_strategy": "NO_SHARD"}),
        ("transformer.decoder", {"sharding_strategy": "FULL_SHARD"}),
        ("", {"sharding_strategy": "FULL_SHARD"}),
    ]
    assert M.resolve_units(t, "root_only") == [("", {})]
    for cls in (M.NestedWrappedModule, M.NonUniformReqGradNWM):
        assert [p for p, _ in M.resolve_units(cls())] == ["module.1.0", "module.1", "module.2", ""]
    assert [p for p, _ in M.resolve_units(M.MLPStack(16, with_seq_parallel=True))] == ["0", "1", "2", ""]
    assert [p for p, _ in M.resolve_units(M.Transformer(M.ModelArgs()))] == ["layers.0", "layers.1", ""]
    assert [p for p, _ in M.resolve_units(M.Net(has_wrapping=True))] == ["net.2", "net", ""]
    assert [p for p, _ in M.resolve_units(M.Net(has_wrapping=False))] == [""]
    assert [p for p, _ in M.resolve_units(M.TwoLinear())] == ["lin2", ""]
    with pytest.raises(KeyError):
        M.resolve_units(t, "nope")


def test_resolve_units_paths_exist_and_are_post_order():
    models = [
        M.TransformerWithSharedParams(),
        M.NestedWrappedModule(),
        M.NonUniformReqGradNWM(),
        M.MLPStack(16),
        M.Transformer(M.ModelArgs()),
        M.Net(True),
        M.TwoLinear(),
    ]
    for model in models:
        variants = list(type(model).WRAP_SPECS) + ["root_only"]
        for variant in variants:
            units = M.resolve_units(model, variant)
            assert units[-1][0] == ""
            paths = [p for p, _ in units]
            assert len(set(paths)) == len(paths)
            for p in paths:
                model.get_submodule(p)
            # post-order: no unit is followed by one of its descendants
            for i, p in enumerate(paths[:-1]):
                assert all(not q.startswith(p + ".") for q in paths[i + 1 :])


def test_the_zoo_preloads_the_modules_that_define_its_models():
    """zoo.MODULES, imported once in a session's parent before its ranks fork (the `rank_preload`
    mark on every zoo cell), are the modules of the zoo's model classes: a rank imports none again."""
    transformers = pytest.importorskip("transformers")
    from shardcheck.conformance.checks.support import zoo

    assert {getattr(transformers, a.model_class).__module__ for a in zoo.ARCHS.values()} == set(zoo.MODULES)
    assert [(m.name, m.args) for m in zoo.PRELOAD] == [("rank_preload", zoo.MODULES)]
