"""Cell ids: a test item's nodeid without the implementation, as manifests and matrices spell cells."""

from __future__ import annotations

from pathlib import Path


def nodeid_of(node) -> str:
    """A test item's or report's nodeid, with its file: pytest leaves the file out ("::test_x[...]")
    when the module itself was the argument (`pytest --pyargs shardcheck.conformance.checks.behaviour.test_train_parity`
    from the user's own folder), and manifests, families and reports name cells by their file."""
    if node.nodeid.startswith("::"):
        return Path(node.location[0]).name + node.nodeid
    return node.nodeid


def strip_impl(nodeid: str, impl_id: str) -> str | None:
    """`shardcheck/conformance/checks/test_f.py::test_x[torch-fsdp2-ws2-1]` -> `test_f.py::test_x[ws2-1]`;
    None when `impl_id` is not one of the item's parameter ids."""
    path, _, rest = nodeid.partition("::")
    name, bracket, params = rest.partition("[")
    params = params[:-1] if bracket else ""
    if params == impl_id:
        params = ""
    elif params.startswith(impl_id + "-"):
        params = params[len(impl_id) + 1:]
    elif params.endswith("-" + impl_id):
        params = params[:-len(impl_id) - 1]
    elif f"-{impl_id}-" in params:
        params = params.replace(f"-{impl_id}-", "-", 1)
    else:
        return None
    return f"{Path(path).name}::{name}" + (f"[{params}]" if params else "")
