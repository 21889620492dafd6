"""Engine registry: profile `engine:` name -> Engine class. Engines never import each other."""

from engines.dense import DenseEngine

ENGINES = {cls.name: cls for cls in (DenseEngine,)}
