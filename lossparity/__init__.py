"""lossparity: the cross-framework parity command (the project's main job)."""
