"""longctx_cli.profiles: defaults < profile < overrides, and errors that name the key."""

from dataclasses import dataclass

import pytest
import yaml

from longctx_cli.errors import ConfigError
from longctx_cli.profiles import (
    Profile,
    RunSettings,
    builtin_profiles_dir,
    list_profiles,
    parse_override,
    resolve_profile,
)


@dataclass
class SparseConfig:
    block_size: int = 16
    keep_ratio: float = 0.1

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not 0 < self.keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")


@dataclass
class WindowConfig:
    window: int = 512


class Sparse:
    Config = SparseConfig


class Window:
    Config = WindowConfig


class Dense:
    @dataclass
    class Config:
        pass


REGISTRY = {"sparse": Sparse, "window": Window, "dense": Dense}


def _profile_file(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _resolve(tmp_path, text, overrides=None):
    return resolve_profile(_profile_file(tmp_path, text), overrides, registry=REGISTRY)


def test_defaults_then_profile_then_overrides(tmp_path):
    p = _resolve(tmp_path, "engine: sparse\nblock_size: 32\nchunk_size: 1024\ntemperature: 1\n")
    assert (p.name, p.engine, p.description) == ("p", "sparse", "")
    assert p.source.endswith("p.yaml")
    assert p.run.chunk_size == 1024 and p.run.max_new_tokens == 64 and p.run.dtype == "auto"
    assert p.run.temperature == 1.0 and isinstance(p.run.temperature, float)
    assert p.run.stop == ["\n\n", "\nQuestion:", "\nAnswer:"] and p.run.decode_graph is True
    assert p.engine_config == SparseConfig(block_size=32, keep_ratio=0.1)

    p = _resolve(tmp_path, "engine: sparse\nblock_size: 32\nchunk_size: 1024\n",
                 {"chunk_size": 256, "keep_ratio": 0.5, "max_new_tokens": None, "device": "cuda:1"})
    assert p.run.chunk_size == 256 and p.run.max_new_tokens == 64 and p.run.device == "cuda:1"
    assert p.engine_config == SparseConfig(block_size=32, keep_ratio=0.5)


def test_engine_override_drops_the_old_engines_parameters(tmp_path):
    p = _resolve(tmp_path, "engine: sparse\nblock_size: 32\nchunk_size: 1024\n", {"engine": "window", "window": 64})
    assert p.engine == "window" and p.engine_config == WindowConfig(64) and p.run.chunk_size == 1024


def test_builtin_dense_profile():
    assert ("dense", "Exact attention; the baseline every engine is compared with.") in list_profiles()
    assert (builtin_profiles_dir() / "dense.yaml").is_file()
    p = resolve_profile("dense", registry=REGISTRY)
    assert (p.name, p.source, p.engine) == ("dense", "builtin", "dense")
    assert (p.run.chunk_size, p.run.max_new_tokens) == (2048, 64)


def test_as_dict_round_trip(tmp_path):
    p = _resolve(tmp_path, "description: x\nengine: sparse\nkeep_ratio: 0.25\nstop: ['###']\n")
    d = p.as_dict()
    assert d["name"] == "p" and d["engine"] == "sparse" and d["keep_ratio"] == 0.25 and d["stop"] == ["###"]
    flat = {k: v for k, v in d.items() if k not in ("name", "source")}
    again = resolve_profile(_profile_file(tmp_path, yaml.safe_dump(flat), "again.yaml"), registry=REGISTRY)
    assert again.as_dict() == {**d, "name": "again", "source": again.source}
    assert again.run == p.run and again.engine_config == p.engine_config


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown profile 'nope'; available: .*dense"):
        resolve_profile("nope", registry=REGISTRY)
    with pytest.raises(ConfigError, match="no such profile file: missing/p.yaml"):
        resolve_profile("missing/p.yaml", registry=REGISTRY)


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match=r"p\.yaml:3:\d+: malformed YAML"):
        _resolve(tmp_path, "engine: sparse\nchunk_size: 1024\nstop: a: b\n")


@pytest.mark.parametrize("text", ["- engine: sparse\n", "just a string\n", ""], ids=["list", "scalar", "empty"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    with pytest.raises(ConfigError, match="mapping"):
        _resolve(tmp_path, text)


def test_missing_and_unknown_engine(tmp_path):
    with pytest.raises(ConfigError, match="missing key 'engine'"):
        _resolve(tmp_path, "chunk_size: 1024\n")
    with pytest.raises(ConfigError, match=r"unknown engine 'resa'; available engines: dense, sparse, window"):
        _resolve(tmp_path, "engine: resa\n")
    with pytest.raises(ConfigError, match="unknown engine 'nope'"):
        _resolve(tmp_path, "engine: sparse\n", {"engine": "nope"})


@pytest.mark.parametrize("overrides", [None, {"chunk_sise": 4}], ids=["in-file", "override"])
def test_unknown_key_lists_allowed_keys(tmp_path, overrides):
    text = "engine: sparse\n" + ("" if overrides else "chunk_sise: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'chunk_sise' for engine sparse; allowed keys: .*") as err:
        _resolve(tmp_path, text, overrides)
    for key in ("description", "engine", "chunk_size", "decode_graph", "block_size", "keep_ratio"):
        assert key in str(err.value)
    # window's parameter is not sparse's
    with pytest.raises(ConfigError, match="unknown key 'window'"):
        _resolve(tmp_path, "engine: sparse\nwindow: 3\n")


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("chunk_size", "abc", "an integer"),
        ("chunk_size", 1.5, "an integer"),
        ("chunk_size", 0, "> 0"),
        ("max_new_tokens", True, "an integer"),
        ("dtype", "fp8", "float32"),
        ("device", "gpu", "cuda:N"),
        ("temperature", -0.1, ">= 0"),
        ("top_p", 0, r"\(0, 1\]"),
        ("top_p", 1.5, r"\(0, 1\]"),
        ("seed", "1", "an integer"),
        ("stop", "\n\n", "a list of strings"),
        ("stop", ["a", 3], r"stop\[1\]: 3; expected a string"),
        ("stop", [""], "non-empty"),
        ("decode_graph", "yes", "true or false"),
        ("block_size", "big", "an integer"),
        ("block_size", -1, "block_size must be > 0"),
        ("keep_ratio", 2, r"\(0, 1\]"),
        ("description", 5, "a string"),
    ],
)
def test_bad_value_names_key_value_and_allowed(tmp_path, key, value, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        _resolve(tmp_path, "engine: sparse\n", {key: value})
    assert key in str(err.value) and str(err.value).startswith("command line: ")
    if key != "block_size" and value != ["a", 3]:  # the fake engine's message and stop[1] show the value their way
        assert repr(value) in str(err.value)


def test_bad_value_in_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"p\.yaml: bad value for max_new_tokens: 'many'"):
        _resolve(tmp_path, "engine: sparse\nmax_new_tokens: many\n")


def test_run_settings_validate_on_construction():
    with pytest.raises(ValueError, match="chunk_size"):
        RunSettings(chunk_size=0)
    assert RunSettings(temperature=1).temperature == 1.0
    assert RunSettings().stop is not RunSettings().stop  # a fresh default list each time


@pytest.mark.parametrize(
    "text, expected",
    [
        ("chunk_size=1024", ("chunk_size", 1024)),
        ("top_p=0.9", ("top_p", 0.9)),
        ("temperature=1e-3", ("temperature", 0.001)),
        ("decode_graph=false", ("decode_graph", False)),
        ('stop=[a, "\\n\\n"]', ("stop", ["a", "\n\n"])),
        ("dtype=bfloat16", ("dtype", "bfloat16")),
        ("device=cuda:1", ("device", "cuda:1")),
        ("max-new-tokens=8", ("max_new_tokens", 8)),
        ("description=a=b", ("description", "a=b")),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["chunk_size", "=3", "seed="])
def test_parse_override_rejects(text):
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_override_that_is_not_yaml_is_refused_for_non_string_keys():
    """`stop=[a` is kept as typed (a string key would take it) and refused where a list is expected."""
    key, value = parse_override("stop=[a")
    with pytest.raises(ConfigError, match="stop.*not valid YAML"):
        resolve_profile("dense", {key: value})


def test_set_null_clears_a_profile_key(tmp_path):
    """`--set compensate_layers=null` sets the key to null (every retrieving layer), where a flag not given (None)
    leaves the profile's value alone."""
    profile = tmp_path / "first.yaml"
    profile.write_text("engine: ltri-stream\ncompensate: exact\ncompensate_layers: first\n")
    key, value = parse_override("compensate_layers=null")
    assert resolve_profile(str(profile), {}).engine_config.compensate_layers == "first"
    assert resolve_profile(str(profile), {key: value}).engine_config.compensate_layers is None
    assert resolve_profile(str(profile), {key: None}).engine_config.compensate_layers == "first"


def test_profile_is_a_plain_dataclass():
    p = Profile("n", "builtin", "", "window", RunSettings(), WindowConfig())
    assert p.as_dict()["window"] == 512 and p.as_dict()["chunk_size"] == 2048
