"""`ltri-stream`: Ltri-LLM streaming with span retrieval (engine.py; spans.py, index.py, cache.py, memory.py)."""

from engines.ltri.engine import LtriConfig, LtriEngine

__all__ = ["LtriConfig", "LtriEngine"]
