"""Typed configs from YAML files and dotted `key=value` overrides.

Configs are nested dataclasses. Loading checks every key and value against the dataclass fields,
so a typo or a wrong type fails at once with the key's full dotted name, the bad value and the
nearest valid key or the accepted values; nothing is `exec`ed and nothing unknown is kept.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the config's fields."""


def from_dict(cls: type[T], data: dict[str, Any] | None, *, prefix: str = "") -> T:
    """Build dataclass `cls` from a plain mapping, recursing into nested dataclass fields."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}: {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}{_suggest(str(key), fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # __post_init__ validation
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Defaults of `cls`, then the YAML file at `path`, then each `a.b.c=value` override in order."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        apply_override(data, item)
    return from_dict(cls, data)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so `3`, `0.5`, `true`, `[1, 2]`)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc


def dump_yaml(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False), encoding="utf-8")


def _suggest(key: str, known: Sequence[str] | dict[str, Any]) -> str:
    names = sorted(known)
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (known: {', '.join(names)})"


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=key + ".")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint_text = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}={value!r} is not accepted{hint_text} (accepted: {', '.join(map(str, allowed))})")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}={value!r} fits none of {hint}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item_hint, *_rest) = typing.get_args(hint) or (Any,)
        items = [_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {hint!r}")


# ---------------------------------------------------------------- the run config
# Sections that belong to one component are declared beside it (RolloutConfig in rollout.py,
# PredictorConfig in predictor/hashed.py, SFTConfig in train/sft.py, TrainConfig in
# train/trainer.py); the run-level ones are here.


@dataclass
class ModelConfig:
    """Which policy, where it runs, and how it generates."""

    name: str = "tiny"
    """`tiny`, `smollm2-135m`, a local Hugging Face model folder, or a hub id (needs the network)."""
    warm_start: bool = True
    """Fine-tune on scripted demonstrations first (cached by config hash); see `sft`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    engine: Literal["hf", "openai"] = "hf"
    """`hf`: transformers in this process; `openai`: a vLLM / SGLang server at `server_urls`."""
    server_urls: list[str] = field(default_factory=list)
    max_batch_size: int = 64
    """Sequences the `hf` engine decodes together."""
    prefix_cache_mb: float = 1024.0
    """Memory the `hf` engine may keep for the KV caches of earlier turns and branches (0: none, every
    prompt is prefilled whole); emptied whenever the weights change."""
    cpu_threads: int = 1
    """torch CPU threads. One is fastest for the tiny model (its ops are too small to split) and does
    not collapse when other jobs share the cores, as busy-waiting worker threads do; raise it for
    larger models on an idle machine."""

    def __post_init__(self) -> None:
        if not (self.prefix_cache_mb >= 0 and self.prefix_cache_mb < float("inf")):
            raise ValueError(f"prefix_cache_mb must be a finite number >= 0, got {self.prefix_cache_mb!r}")


@dataclass
class TaskConfig:
    """The task set and the env the agent acts in."""

    name: str = "multihop"
    """A name `trace_rl.agent.tasks.load_taskset` accepts (`multihop`, `toolmath`, `rg:<dataset>`, ...)."""
    train_tasks: int | None = None
    """Train tasks kept for RL (None: all)."""
    demo_tasks: int | None = None
    """Tasks of the train split set aside for the warm start's demonstrations only (a seeded draw);
    RL trains on the rest, so the warm-started policy has never seen the RL questions and its success
    on them matches its held-out success, as when a paper starts RL from a separately trained model.
    None: the warm start demonstrates on the RL train split itself."""
    test_tasks: int | None = 128
    """Held-out tasks for evaluation (None: all)."""
    format: Literal["tag", "json"] = "tag"
    max_turns: int = 5
    topk: int = 2
    """Passages per search. Two keep the `multihop` oracle at 100% and make search results about 30%
    shorter than three (whole demonstrations and rollout contexts about 20%)."""
    max_observation_chars: int = 1500
    search_url: str | None = None
    """A Search-R1 / verl retrieval server instead of the local BM25 index."""
    seed: int = 0
    """Seed of the generated task world (independent of the run seed)."""

    def __post_init__(self) -> None:
        if self.demo_tasks is not None and self.demo_tasks < 1:
            raise ValueError(f"demo_tasks must be >= 1 or null, got {self.demo_tasks!r}")
