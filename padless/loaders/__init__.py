"""Dataset readers and batch samplers (see DESIGN.md; not built yet)."""
