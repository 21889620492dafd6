"""longctx: ask questions of very long documents."""

__version__ = "0.1.0"
