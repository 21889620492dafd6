"""`ltri-stream`: Ltri-LLM streaming with span retrieval (engine.py; config.py, spans.py, index.py, cache.py,
memory.py). The engine is `engines.ltri.engine.LtriEngine`, loaded through `engines.ENGINES`."""

from engines.ltri.config import LtriConfig

__all__ = ["LtriConfig"]
