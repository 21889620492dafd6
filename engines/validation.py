"""How engine configurations validate their fields (torch-free; engines/config.py and engines/ltri/config.py)."""


def require(ok: bool, name: str, value, expected: str) -> None:
    """How engine configs validate a field in `__post_init__`: a ValueError that names it."""
    if not ok:
        raise ValueError(f"bad value for {name}: {value!r}; expected {expected}")
