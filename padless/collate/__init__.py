"""Collation of variable-size samples into packed batches (see DESIGN.md; not built yet)."""
