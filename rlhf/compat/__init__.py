"""Code of other projects served under their own names (OpenRLHF\x27s math helpers for its example files)."""
