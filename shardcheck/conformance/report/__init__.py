"""Conformance reports: the versioned schema (schema.json) and its reading (reading.py: validation,
version 1 upgraded), the writer (writer.py: a pytest plugin streaming cells as they finish), coverage
and conformance per implementation and layer (coverage.py), cell ids (cells.py), the
cross-implementation matrix (matrix.py, its HTML page page.py) and the diff of two reports (diff.py)."""
