"""The names of the reference modes, torch-free so the config can offer them as its choices
(``reference.modes.REFERENCE_MODES`` maps each to its class; tests/test_layout.py checks they agree)."""

REFERENCE_MODE_NAMES: tuple[str, ...] = ("copy", "adapter", "precomputed", "none")
