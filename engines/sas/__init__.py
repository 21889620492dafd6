"""`sas-pattern`: pattern language (pattern.py, parse.py), analyzer (analyzer.py), cache and engine (engine.py,
`engines.sas.engine.SasEngine`, loaded through `engines.ENGINES`)."""
