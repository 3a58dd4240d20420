"""What an engine's documentation promises where engines legitimately differ, with where it says so:
the checks read an adapter's `documented` (a `Documented`) to choose the yardstick of such a cell,
so that a documented difference is judged against the engine's own promise, and a broken promise is
a bug (docs/findings.md).

An adapter without `documented` promises torch's semantics (`TORCH`): what unsharded data-parallel
training does with the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

AS_LOADED, FLOAT32 = "as loaded", "float32"


@dataclass(frozen=True)
class Documented:
    """`low_precision_load`: the dtype of the master weights the optimizer steps when the model
    arrives in low precision (`from_pretrained(dtype=torch.bfloat16)`) under a mixed-precision
    policy: AS_LOADED (the parameters as given, as torch's optimizers step them) or FLOAT32 (the engine
    upcasts them and keeps float32 master weights). `source`: the page that says so."""

    low_precision_load: str = AS_LOADED
    source: str | None = None

    def __post_init__(self) -> None:
        if self.low_precision_load not in (AS_LOADED, FLOAT32):
            raise ValueError(f"low_precision_load = {self.low_precision_load!r}: one of {AS_LOADED!r}, {FLOAT32!r}")


TORCH = Documented()


def of(adapter: object) -> Documented:
    documented: Documented | None = getattr(adapter, "documented", None)
    return documented or TORCH
