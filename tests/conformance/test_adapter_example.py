"""The guide's worked example (shardcheck/conformance/examples/allreduce_engine.py) is a working adapter: an engine that
owns its step reaches the behaviour cells it declares and passes them; a broken copy of it fails."""

from pathlib import Path

import warm_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "shardcheck.conformance.examples.allreduce_engine:AllReduceAdapter"


def _run(impl: str, *extra: str):
    return warm_python.run(["-m", "pytest", "shardcheck/conformance/checks/behaviour/test_train_parity.py",
                            "--shardcheck-impl", impl, "--shardcheck-world-sizes", "2", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                            "-k", "NO_SHARD and (norm2 or noclip)", *extra], cwd=ROOT, timeout=600)


def test_example_adapter_passes_what_it_declares():
    proc = _run(EXAMPLE)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "4 passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]


def test_example_adapter_that_forgets_to_average_fails(tmp_path):
    (tmp_path / "summing_engine.py").write_text(
        "from shardcheck.conformance.examples import allreduce_engine as e\n"
        "class Summing(e.AllReduceEngine):\n"
        "    def backward(self, loss):\n"
        "        loss.backward()\n"
        "        import torch.distributed as dist\n"
        "        for p in self.module.parameters():\n"
        "            dist.all_reduce(p.grad, group=self.group)  # summed, never divided\n"
        "e.AllReduceEngine = Summing\n"
        "Adapter = e.AllReduceAdapter\n")
    proc = warm_python.run(["-m", "pytest", "shardcheck/conformance/checks/behaviour/test_train_parity.py",
                            "--shardcheck-impl", "summing_engine:Adapter", "--shardcheck-world-sizes", "2", "-q", "-o", "addopts=",
                            "-p", "no:cacheprovider", "-k", "NO_SHARD and noclip and uneven_mlp"],
                           cwd=ROOT, timeout=600, env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-3000:]
    assert "gradients" in proc.stdout, proc.stdout[-3000:]
