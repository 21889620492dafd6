"""How engine configurations validate their fields (torch-free; engines/config.py and engines/ltri/config.py)."""

# Where a streaming engine's tokens sit for RoPE (engines/positions.py): "document" their offsets in the
# document, "cache" positions re-assigned within what attention sees, "auto" the document's while it fits the
# model's context and re-assigned past it.
POSITIONS = ("auto", "document", "cache")


def require(ok: bool, name: str, value, expected: str) -> None:
    """How engine configs validate a field in `__post_init__`: a ValueError that names it."""
    if not ok:
        raise ValueError(f"bad value for {name}: {value!r}; expected {expected}")


def require_positions(value) -> None:
    require(value in POSITIONS, "positions", value, " or ".join(POSITIONS))
