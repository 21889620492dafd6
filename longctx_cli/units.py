"""Counts the command line takes in short form: 4096, 32k, 1m tokens."""

from __future__ import annotations

from longctx_cli.errors import ConfigError


def parse_count(text: str) -> int:
    """'128k' -> 131072, '1m' -> 1048576, '5000' -> 5000."""
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ConfigError(f"not a token count: {text!r} (use e.g. 4096, 32k, 1m)") from None
