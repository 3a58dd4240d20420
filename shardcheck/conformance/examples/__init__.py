"""Worked examples that ship with the package: copy one to start an adapter of your own."""
