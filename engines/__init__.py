"""Engine registry: profile `engine:` name -> Engine class. Engines never import each other.

`ENGINES` loads the engine modules (torch, transformers) on first use; `engines.config.CONFIGS` holds their
configurations alone, for reading profiles without them.
"""

import importlib

_CLASSES = {"dense": ("engines.dense", "DenseEngine"), "ltri-stream": ("engines.ltri.engine", "LtriEngine"),
            "resa": ("engines.resa.engine", "ResaEngine"), "sas-pattern": ("engines.sas.engine", "SasEngine"),
            "star": ("engines.star.engine", "StarEngine")}


def __getattr__(name: str):
    if name == "ENGINES":
        engines = {key: getattr(importlib.import_module(module), cls) for key, (module, cls) in _CLASSES.items()}
        globals()["ENGINES"] = engines
        return engines
    raise AttributeError(f"module 'engines' has no attribute {name!r}")
