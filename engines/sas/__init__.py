"""`sas-pattern`: pattern language (pattern.py, parse.py), analyzer (analyzer.py), cache and engine."""

from engines.sas.engine import SasEngine

__all__ = ["SasEngine"]
