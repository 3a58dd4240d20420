"""Known failures per implementation (`<impl>.toml`), their findings (FINDINGS.md) and the minimal
reproductions (repros/). `manifest.py` reads a manifest; the format is in docs/adapters.md."""
