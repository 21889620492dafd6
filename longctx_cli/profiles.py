"""Profiles: a flat YAML file names an engine, its parameters and the run settings.

Resolution order: dataclass defaults < profile file < command-line overrides (`--set key=value`, flags).
Engines are looked up in a registry ({name: configuration class}, `engines.config.CONFIGS` by default, which
imports neither torch nor transformers; engine classes with a `Config` also do), whose fields are that engine's
parameters.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from longctx_cli.errors import ConfigError, clip

DTYPES = ("auto", "float32", "bfloat16", "float16")
META_KEYS = ("description", "engine")


@dataclass
class RunSettings:
    """Settings every engine shares; validated on construction (ValueError names the field)."""

    chunk_size: int = 2048  # prefill chunk length in tokens
    max_new_tokens: int = 64
    dtype: str = "auto"  # bf16 on GPU, fp32 on CPU
    device: str = "auto"
    # Split the model's layers in order over this many local GPUs (longctx_cli/split.py); null: one device, or
    # accelerate's own placement over every GPU for --device auto
    gpus_model: int | None = None
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    # A base model runs on past its answer into invented "Question:" lines; these end the answer.
    stop: list[str] = field(default_factory=lambda: ["\n\n", "\nQuestion:", "\nAnswer:"])
    decode_graph: bool = True  # capture the GPU decode step as a CUDA graph
    # torch.compile the layers' MLPs and norms inside that graph: faster tokens, a one-off compilation first
    compile_decode: bool = False
    # one GEMV for q, k and v, and one for gate and up, inside that graph (weights regrouped in place, no copy)
    fuse_projections: bool = True
    # replay the layers' norms and MLPs (and ltri-stream's query side) as CUDA graphs in long GPU prefills
    prefill_graphs: bool = True
    # Saved document states ($LONGCTX_HOME/states) are kept within this size; the least recently used go first.
    state_cache_gib: float = 20.0

    def __post_init__(self):
        hints = typing.get_type_hints(RunSettings)
        for f in dataclasses.fields(self):
            setattr(self, f.name, check_type(f.name, getattr(self, f.name), hints[f.name]))
        _require(self.chunk_size > 0, "chunk_size", self.chunk_size, "an integer > 0")
        _require(self.max_new_tokens > 0, "max_new_tokens", self.max_new_tokens, "an integer > 0")
        _require(self.dtype in DTYPES, "dtype", self.dtype, "one of " + ", ".join(DTYPES))
        device_ok = re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None
        _require(device_ok, "device", self.device, "auto, cpu, cuda or cuda:N")
        _require(self.gpus_model is None or self.gpus_model >= 1, "gpus_model", self.gpus_model,
                 "an integer >= 1 or null")
        _require(self.temperature >= 0, "temperature", self.temperature, "a number >= 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _require(0 <= self.seed < 2**63, "seed", self.seed, "an integer from 0 to 2**63 - 1")
        _require(self.state_cache_gib >= 0, "state_cache_gib", self.state_cache_gib, "a number of GiB >= 0")
        _require(all(self.stop), "stop", self.stop, "a list of non-empty strings")


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"bad value for {name}: {value!r}; expected {allowed}")


def check_type(name: str, value, hint):
    """Return `value` checked against the annotation `hint` (ints widen to float, lists to tuples).

    YAML gives bool, int, float, str, list and dict; anything else in `hint` is left to __post_init__.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return check_type(name, value, option)
            except ValueError:
                pass
        raise ValueError(f"bad value for {name}: {value!r}; expected {_describe(hint)}")
    if hint is type(None):
        ok = value is None
    elif hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is typing.Literal:
        ok = value in args
    elif origin in (list, tuple):
        ok = isinstance(value, (list, tuple))
        item = args[0] if args else typing.Any
        if ok and item is not typing.Any:
            value = [check_type(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
        value = origin(value) if ok else value
    else:
        return value
    if not ok:
        raise ValueError(f"bad value for {name}: {value!r}; expected {_describe(hint)}")
    return value


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple):
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(args[0], 'values') if args else 'values'}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


@dataclass
class Profile:
    name: str
    source: str  # path of the YAML file, or "builtin"
    description: str
    engine: str
    run: RunSettings
    engine_config: object  # an instance of registry[engine].Config

    def as_dict(self) -> dict:
        """Resolved settings, flat like the YAML file (plus name and source), JSON- and YAML-safe."""
        params = {f.name: getattr(self.engine_config, f.name) for f in dataclasses.fields(self.engine_config)}
        settings = {**dataclasses.asdict(self.run), **params}
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
        meta = {"name": self.name, "source": self.source, "description": self.description, "engine": self.engine}
        return {**meta, **plain}


def builtin_profiles_dir() -> Path:
    """The installed `profiles` package folder, where the shipped *.yaml files live."""
    return Path(importlib.import_module("profiles").__file__).parent


def list_profiles() -> list[tuple[str, str]]:
    """(name, description) of every builtin profile, sorted by name."""
    files = sorted(builtin_profiles_dir().glob("*.yaml"))
    return [(f.stem, str(_load_yaml(f).get("description", ""))) for f in files]


@dataclass(frozen=True)
class Verbatim:
    """A --set value whose text YAML reads as something other than plain text (a mapping for `keys=0: 32`, a tag
    for `!Diag()`, or an error): the text itself goes to keys that take a string, the YAML value elsewhere."""

    text: str
    parsed: object = None
    problem: str | None = None  # the YAML error, when it did not parse


class _Null:
    """`--set key=null`: the key set to null. None among overrides means a flag not given, which changes nothing."""

    def __repr__(self) -> str:
        return "null"


NULL = _Null()


def parse_override(text: str) -> tuple[str, object]:
    """`--set key=value` -> (key, value); the value is YAML (1024 -> int, true -> bool, [a, b] -> list, null ->
    NULL)."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key or not raw.strip():
        raise ConfigError(f"--set expects key=value, got {clip(text)}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        return key, Verbatim(raw.strip(), problem=getattr(e, "problem", None) or str(e).splitlines()[0])
    # YAML 1.1 reads 1e-3 (no dot) as a string; on a command line it means the number.
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
        value = float(value)
    if isinstance(value, dict) or raw.lstrip().startswith("!"):
        return key, Verbatim(raw.strip(), value)
    return key, NULL if value is None else value


def _choose(key: str, value, hint):
    """The value a --set key gets: the text for string keys when YAML read it otherwise, else the YAML value."""
    if not isinstance(value, Verbatim):
        return check_type(key, value, hint)
    try:
        return check_type(key, value.text, hint)
    except ValueError:
        if value.problem is not None:
            raise ValueError(f"bad value for {key}: {clip(value.text)} is not valid YAML ({value.problem})") from None
        return check_type(key, value.parsed, hint)


def read_profile(name_or_path: str) -> tuple[str, str, dict]:
    """(name, source, settings) of a builtin profile or a .yaml file, unvalidated: what can be refused (no such
    profile, malformed YAML) without importing the engines."""
    path, name, source = _locate(name_or_path)
    return name, source, _load_yaml(path)


def resolve_profile(name_or_path: str, overrides: dict[str, object] | None = None, registry=None) -> Profile:
    """Load a builtin profile (by name) or a .yaml file, apply `overrides` (None values ignored, NULL sets null),
    validate."""
    name, source, settings = read_profile(name_or_path)
    where = f"profile {name}" if source == "builtin" else name_or_path
    overrides = {k: None if v is NULL else v for k, v in (overrides or {}).items() if v is not None}
    if registry is None:
        from engines.config import CONFIGS as registry  # the configurations alone: no torch, no transformers
    engines = ", ".join(sorted(registry))
    file_engine = settings.get("engine")
    engine = overrides.get("engine", file_engine)
    if engine is None:
        raise ConfigError(f"{where}: missing key 'engine'; one of: {engines}")
    if not isinstance(engine, str) or engine not in registry:
        raise ConfigError(f"{where}: unknown engine {engine!r}; available engines: {engines}")
    config_cls = _config_class(registry[engine])
    run_fields = [f.name for f in dataclasses.fields(RunSettings)]
    engine_fields = [f.name for f in dataclasses.fields(config_cls)]
    if clash := set(run_fields) & set(engine_fields):
        raise ConfigError(f"engine {engine}: Config fields {sorted(clash)} shadow run settings of the same name")
    # A profile's parameters for its own engine do not carry over when --set engine=... picks another one.
    if engine != file_engine and isinstance(file_engine, str) and file_engine in registry:
        stale = {f.name for f in dataclasses.fields(_config_class(registry[file_engine]))} - {*run_fields,
                                                                                            *engine_fields}
        settings = {k: v for k, v in settings.items() if k not in stale}
    allowed = [*META_KEYS, *run_fields, *engine_fields]
    origin = {**dict.fromkeys(settings, where), **dict.fromkeys(overrides, "command line")}
    for key, came_from in origin.items():
        if key not in allowed:
            keys = ", ".join(allowed)
            raise ConfigError(f"{came_from}: unknown key {key!r} for engine {engine}; allowed keys: {keys}")
    merged = {**settings, **overrides}
    description = merged.get("description") or ""
    if not isinstance(description, str):
        raise ConfigError(f"{origin['description']}: bad value for description: {description!r}; expected a string")
    run = _build(RunSettings, {k: merged[k] for k in run_fields if k in merged}, origin, where)
    params = {k: merged[k] for k in engine_fields if k in merged}
    config = _build(config_cls, params, origin, f"{where} (engine {engine})")
    return Profile(name, source, description, engine, run, config)


def _config_class(entry) -> type:
    """A registry entry is an engine class (with its `Config`) or a configuration class itself."""
    return getattr(entry, "Config", entry)


def _build(cls, values: dict, origin: dict[str, str], where: str):
    """Type-check `values` against cls's annotations, then construct it (its __post_init__ checks ranges).

    Errors start with where the offending value came from: the profile file or the command line.
    """
    required = [f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING]
    if missing := [name for name in required if name not in values]:
        raise ConfigError(f"{where}: missing key {missing[0]!r}, which has no default")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # annotations that do not resolve: leave the checks to __post_init__
        hints = {}
    checked = {}
    for key, value in values.items():
        try:
            checked[key] = _choose(key, value, hints.get(key, typing.Any))
        except ValueError as e:
            raise ConfigError(f"{origin[key]}: {e}") from None
    try:
        return cls(**checked)
    except ValueError as e:
        # __post_init__ names the field; blame the source of the first key its message mentions.
        named = [k for k in values if re.search(rf"\b{re.escape(k)}\b", str(e))]
        raise ConfigError(f"{origin[named[0]] if named else where}: {e}") from None


def _locate(name_or_path: str) -> tuple[Path, str, str]:
    """(path, name, source) for a builtin profile name or a path to a .yaml file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        if not path.is_file():
            raise ConfigError(f"no such profile file: {name_or_path}")
        return path, path.stem, str(path)
    builtin = builtin_profiles_dir() / f"{name_or_path}.yaml"
    if not builtin.is_file():
        names = ", ".join(n for n, _ in list_profiles())
        raise ConfigError(f"unknown profile {name_or_path!r}; available: {names} (or a path to a .yaml file)")
    return builtin, name_or_path, "builtin"


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        hint = ("; quote values that hold ': ' or start with '!', e.g. pattern: \"~Diag(window=64)\""
                if isinstance(e, (yaml.constructor.ConstructorError, yaml.scanner.ScannerError)) else "")
        raise ConfigError(f"{path}{at}: malformed YAML: {e.problem or e.context}{hint}") from None
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read profile: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level, got {type(data).__name__}")
    return {str(k): v for k, v in data.items()}
