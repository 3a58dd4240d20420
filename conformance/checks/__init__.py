"""The conformance checks, one family per concern; a family's checks live in test_<family>*.py."""

FAMILIES = ("clip_grad", "grad_scaler", "extensions", "comm_hooks")


def family_of_file(stem: str) -> str:
    """`test_clip_grad_dtensor` -> `clip_grad` (the family whose name the file name starts with)."""
    name = stem.removeprefix("test_")
    return max((f for f in FAMILIES if name.startswith(f)), key=len, default=name)
