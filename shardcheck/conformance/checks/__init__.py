"""The conformance checks, in two layers, one family per concern; a family's checks live in
test_<family>*.py.

* behaviour/: what every correct data-parallel trainer does, judged through `Adapter.trainer`
  (parity with unsharded training step by step, loss scaling, mixed precision; explore: drawn
  configurations, shardcheck/conformance/explore/; training_loop: accumulation, eval between steps, frozen /
  unused / tied parameters and the observed dtype contract). Any engine.
* api/: torch's FSDP-style APIs (clip_grad_norm_ on a module, sharded GradScaler, comm hooks,
  all-gather extensions), reached only by implementations that expose them.
"""

from pathlib import Path

LAYERS = {
    "behaviour": ("train_parity", "loss_scaling", "mixed_precision", "explore", "checkpoint", "sharding", "training_loop",
                  "composition", "models"),
    "api": ("clip_grad", "grad_scaler", "extensions", "comm_hooks"),
}
FAMILIES = tuple(f for families in LAYERS.values() for f in families)
# Run when asked (`--family models`, `--model`): real architectures cost more than the whole default
# matrix's budget allows, and need an extra (shardcheck[models]).
OPT_IN = ("models",)
DEFAULT_FAMILIES = tuple(f for f in FAMILIES if f not in OPT_IN)


def family_of_file(stem: str) -> str:
    """`test_clip_grad_dtensor` -> `clip_grad` (the family whose name the file name starts with)."""
    name = stem.removeprefix("test_")
    return max((f for f in FAMILIES if name.startswith(f)), key=len, default=name)


def layer_of_family(family: str) -> str | None:
    return next((layer for layer, families in LAYERS.items() if family in families), None)


def files_of(families) -> list[Path]:
    """The check files of `families`, in both layers."""
    here = Path(__file__).parent
    return sorted(p for f in families for p in here.glob(f"*/test_{f}*.py"))
