"""Conformance reports: the versioned schema, the writer (a pytest plugin streaming cells as they
finish), cell ids, the cross-implementation matrix and the diff of two reports."""
