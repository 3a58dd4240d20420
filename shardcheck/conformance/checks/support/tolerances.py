"""The comparison tolerance of each dtype, by the dtype's name (torch.testing's defaults): one table
for the checks (shardcheck.conformance.checks.support.compare) and for the reports, which name a cell's dtype
from the tolerance it was compared with and must not import torch to do so."""

from __future__ import annotations

BY_DTYPE = {  # dtype name: (rtol, atol)
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}


def dtype_of(tolerances) -> str:
    """The dtype a cell was compared as, from its (rtol, atol) pairs: the loosest one's (a cell that
    compared several dtypes is named by its lowest precision); "other" for a tolerance of no dtype."""
    names = {tuple(v): k for k, v in BY_DTYPE.items()}
    found = [names.get(tuple(pair), "other") for pair in tolerances]
    return max(found, key=lambda name: BY_DTYPE.get(name, (-1.0,))[0], default="none")
