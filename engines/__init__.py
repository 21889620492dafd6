"""Engine registry: profile `engine:` name -> Engine class. Engines never import each other."""

from engines.dense import DenseEngine
from engines.ltri import LtriEngine
from engines.resa import ResaEngine
from engines.sas import SasEngine
from engines.star import StarEngine

ENGINES = {cls.name: cls for cls in (DenseEngine, LtriEngine, ResaEngine, SasEngine, StarEngine)}
