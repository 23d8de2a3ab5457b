"""Typed configs from YAML files and dotted `key=value` overrides.

Configs are nested dataclasses. Loading checks every key and value against the dataclass fields,
so a typo or a wrong type fails at once with the key's full dotted name, the bad value and the
nearest valid key or the accepted values; nothing is `exec`ed and nothing unknown is kept.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
import urllib.parse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from trace_rl.infra.references import is_reference

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the config's fields."""


class FieldError(ConfigError):
    """One field's value outside what it accepts, raised by a config's `__post_init__`.

    `name` is relative to the dataclass that raised it; `from_dict` puts the section's dotted path in
    front, so the message names the full key (`train.grad_clip must be > 0 ..., got -1.0`).
    """

    def __init__(self, name: str, value: Any, accepted: str, hint: str = "") -> None:
        self.name, self.value, self.accepted, self.hint = name, value, accepted, hint
        super().__init__(f"{name} must be {accepted}, got {_show(value)}{hint}")

    def under(self, prefix: str) -> FieldError:
        """The same error with `prefix` (a section's dotted path, ending in '.') before the name."""
        return FieldError(prefix + self.name, self.value, self.accepted, self.hint)


MAX_SEED = 2**32 - 1
"""Largest seed: every RNG the run seeds (numpy, torch, Python's) accepts [0, 2**32)."""


def check_range(
    config: Any,
    name: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    nullable: bool = False,
    why: str = "",
) -> None:
    """FieldError unless `config.<name>` is a number within the bounds (pydantic's gt / ge / lt / le).

    NaN and ±inf are never within them, so a float field cannot slip through a comparison that NaN
    makes false; None is accepted only when `nullable`. `why` says what the bound protects.
    """
    value = getattr(config, name)
    if value is None and nullable:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    finite = number and (isinstance(value, int) or math.isfinite(value))
    if finite and (gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt) and (le is None or value <= le):
        return
    opening, low = ("(", gt) if gt is not None else ("[", ge)
    closing, high = (")", lt) if lt is not None else ("]", le)
    if low is not None and high is not None:
        bounds = f"in {opening}{low}, {high}{closing}"
    elif low is not None:
        bounds = f"{'>' if opening == '(' else '>='} {low}"
    else:
        bounds = f"{'<' if closing == ')' else '<='} {high}"
    accepted = ("a finite number " if number and not finite else "") + bounds + (" or null" if nullable else "")
    raise FieldError(name, value, accepted + (f" ({why})" if why else ""))


def check_choice(config: Any, name: str, choices: Sequence[str], *, nullable: bool = False) -> None:
    """FieldError unless `config.<name>` is one of `choices` (or None when `nullable`), with the nearest one."""
    value = getattr(config, name)
    if (value is None and nullable) or (isinstance(value, str) and value in choices):
        return
    raise FieldError(name, value, "one of " + ", ".join(choices) + (" or null" if nullable else ""), did_you_mean(value, choices))


def did_you_mean(value: Any, choices: Sequence[str]) -> str:
    """`; did you mean 'x'?` naming the choice nearest `value`, or "" when none is near.

    Only a short string is compared: `str()` of a hostile value (a list nested a thousand deep, a
    million-character string) would cost far more than a suggestion is worth.
    """
    if not isinstance(value, str) or len(value) > 200:
        return ""
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def is_http_url(text: str) -> bool:
    """Whether `text` is an http(s) URL with a host: what the server and retrieval clients can reach."""
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


class _BoundedRepr(reprlib.Repr):
    """reprlib's repr, which looks at a bounded part of a value (a few items of a few levels), and
    never fails on an integer too long for `str()` (Python refuses over 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 4, 6, 6
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6
        self.maxstring = self.maxlong = self.maxother = 60

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:  # over sys.get_int_max_str_digits() digits
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"


_BOUNDED_REPR = _BoundedRepr()


def _show(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to one readable line (a 10**400 budget has
    401 digits). Every user value an error prints goes through here, and the time and memory it takes
    are bounded whatever the value (a string of a million characters, a list nested a thousand deep,
    a list that holds itself, an integer of a million digits): a message never costs more than its line."""
    if isinstance(value, str):
        text = repr(value[:80])
        return text if len(value) <= 80 and len(text) <= 80 else f"{text[:60]}... ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool):
        text = _BOUNDED_REPR.repr_int(value, 0) if value.bit_length() > 15_000 else repr(value)  # str() stops at 4300 digits
        return text if len(text) <= 80 or text.startswith("<") else f"{text[:60]}... ({len(text)} characters)"
    try:
        text = _BOUNDED_REPR.repr(value)
    except Exception:  # noqa: BLE001 - a value whose own __repr__ fails is still shown by its type
        text = f"<{type(value).__name__}>"
    if isinstance(value, (list, tuple, dict, set, frozenset)) and (len(text) > 80 or "..." in text):
        size = f" ({type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'})"
        return (text if len(text) <= 60 else text[:60] + "...") + size
    return text if len(text) <= 80 else f"{text[:60]}..."


show_value = _show
"""`_show` for other modules: a user's value, bounded to one readable line."""


def from_dict(cls: type[T], data: dict[str, Any] | None, *, prefix: str = "") -> T:
    """Build dataclass `cls` from a plain mapping, recursing into nested dataclass fields."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}: {_show(data)}")
    data = _moved_keys(data, getattr(cls, "RENAMED_KEYS", {}), prefix)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown config key {_show(prefix + (key if isinstance(key, str) else _show(key)))}{_suggest(key, fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except FieldError as exc:
        raise exc.under(prefix) from exc
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # __post_init__ validation
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


def _moved_keys(data: dict[str, Any], renamed: dict[str, str], prefix: str) -> dict[str, Any]:
    """`data` with each key a config class renamed (its `RENAMED_KEYS`: old -> new dotted name, relative
    to the class) moved to its new place, with one warning naming them, so configs and run folders
    written before a rename still load; both names given is an error. `data` itself is left as it was."""
    moved = []
    for old, new in renamed.items():
        *old_path, old_key = old.split(".")
        *new_path, new_key = new.split(".")
        source, target = _mapping_at(data, old_path), _mapping_at(data, new_path, missing={})
        if source is None or old_key not in source or target is None:
            continue  # nothing to move, or a section that is not a mapping (from_dict says so)
        if new_key in target:
            raise ConfigError(f"{prefix}{old} and {prefix}{new} are both set: {old} is now {new}; keep only {new}")
        value = source[old_key]
        data = _replaced(data, old_path, {k: v for k, v in source.items() if k != old_key})
        data = _replaced(data, new_path, {**(_mapping_at(data, new_path, missing={}) or {}), new_key: value})
        moved.append(f"{prefix}{old} -> {prefix}{new}")
    if moved:
        warnings.warn(f"renamed config keys, read under their new names: {', '.join(moved)}", FutureWarning, stacklevel=3)
    return data


def _mapping_at(data: dict[str, Any], path: Sequence[str], missing: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The mapping at `path` in `data` (`missing` where a part of the path is absent; None where a part is not a mapping)."""
    for part in path:
        if part not in data:
            return missing
        data = data[part]
        if not isinstance(data, dict):
            return None
    return data


def _replaced(data: dict[str, Any], path: Sequence[str], value: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with the mapping at `path` (made where absent) replaced by `value`."""
    if not path:
        return value
    inner = data.get(path[0], {})
    return {**data, path[0]: _replaced(inner if isinstance(inner, dict) else {}, path[1:], value)}

def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Defaults of `cls`, then the YAML file at `path`, then each `a.b.c=value` override in order."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = load_yaml_file(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        apply_override(data, item)
    return from_dict(cls, data)


# ---------------------------------------------------------------- reading YAML that cannot be turned against the machine

MAX_CONFIG_BYTES = 256 << 10
"""Largest config file (or override value) read: 256 KiB, checked before parsing, on at most this many
bytes read. The largest shipped config is under 5 KB, so this is 50 times any real one; with aliases
refused, what 256 KiB of YAML can build is at most about 130,000 values (a few MB), and PyYAML (pure
Python, about 30 us a value) parses even that worst case in about 4 s, where 1 MiB would take 17 s."""

MAX_YAML_DEPTH = 64
"""Deepest nesting of lists and mappings in a config document. Real configs nest 3 deep; PyYAML
composes a document recursively, so a few thousand `[` would end in a RecursionError, not a message."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader for config files, which refuses what a config never needs and an attacker would use.

    - aliases (`*name`): a few lines of nested aliases (the "billion laughs") make a value that is
      small in memory but expands to billions of items when it is copied (`dataclasses.asdict`),
      printed or saved; no shipped config or test uses anchors, so every alias is refused;
    - nesting deeper than `MAX_YAML_DEPTH`;
    - a key given twice in one mapping, which YAML resolves silently by keeping the last.
    """

    source = "config"
    """What error messages call the document: the file's path, or the override."""

    def compose_document(self) -> Any:
        self._depth = 0
        self._root: yaml.Node | None = None
        return super().compose_document()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"{self.source}, line {event.start_mark.line + 1}: YAML alias *{event.anchor[:40]} refused: a config "
                "takes no anchors or aliases (nested ones expand into billions of values); write the value out"
            )
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise ConfigError(f"{self.source}, line {mark.line + 1}: lists and mappings nested over {MAX_YAML_DEPTH} deep")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if parent is None:
            self._root = node
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the constructor refuses it below
                    continue
                if first is not None:
                    where = f"twice on line {line}" if first == line else f"at lines {first} and {line}"
                    raise ConfigError(
                        f"{self.source}: duplicate key {_show(self._path(node, key))} {where} "
                        "(YAML would silently keep only the last); give it once"
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def _path(self, mapping: yaml.Node, key: Any) -> str:
        """The dotted name of `key` in `mapping`: the mapping's path from the document's root, found
        by a walk of the (alias-free, so tree-shaped and no larger than the file) node tree."""
        stack: list[tuple[yaml.Node, str]] = [(self._root, "")] if self._root is not None else []
        while stack:
            node, path = stack.pop()
            if node is mapping:
                return f"{path}.{key}" if path else str(key)
            if isinstance(node, yaml.MappingNode):
                stack.extend((v, f"{path}.{k.value}" if path else str(k.value)) for k, v in node.value if isinstance(k, yaml.ScalarNode))
            elif isinstance(node, yaml.SequenceNode):
                stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
        return str(key)


def load_yaml(text: str, source: str) -> Any:
    """The data of the YAML document `text`, read as config: the one way this package parses config YAML.

    PyYAML's safe loading, less what a config never needs and a hostile one would use (see
    `_ConfigLoader`: aliases, nesting over `MAX_YAML_DEPTH`, duplicate keys), with text over
    `MAX_CONFIG_BYTES` refused before parsing. Every refusal, and every YAML error, is a one-line
    ConfigError that starts with `source` (a file's path, or `override '...'`).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: over {MAX_CONFIG_BYTES >> 10} KiB of YAML ({len(text)} characters); no config is this large")
    loader = _ConfigLoader(text)
    loader.source = source
    loader.name = source  # PyYAML's own error messages name it instead of "<unicode string>"
    try:
        return loader.get_single_data()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_one_line(exc)[:300]}") from exc
    except (ValueError, RecursionError, MemoryError) as exc:  # e.g. an integer of over 4300 digits, which int() refuses
        raise ConfigError(f"{source}: not a usable YAML value: {_one_line(exc).split(';')[0][:300]}") from exc
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> Any:
    """The data of the config YAML file at `path` (`read_config_text`, then `load_yaml`): what every
    reader of a config file, a run folder's `config.yaml` included, should call instead of
    `yaml.safe_load`, so that none of them expands an alias bomb or keeps half of a duplicate key."""
    return load_yaml(read_config_text(path), str(path))


def read_config_text(path: str | Path) -> str:
    """The text of a config file; ConfigError (one line) for a folder, a missing or unreadable file,
    one over `MAX_CONFIG_BYTES` (found reading at most that many bytes, so /dev/zero is refused too),
    or bytes that are not UTF-8."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config {path} is a folder, not a YAML file")
    try:
        with file.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config {path} cannot be read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} is over {MAX_CONFIG_BYTES >> 10} KiB; no config is this large")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so `3`, `0.5`, `true`, `[1, 2]`),
    as strictly as a config file (`load_yaml`)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {_show(item)} must look like section.key=value")
    source = f"override {_show(item)}"
    value = load_yaml(raw, source) if raw.strip() else ""
    set_dotted(data, key.strip(), value, what=source)


def set_dotted(data: dict[str, Any], key: str, value: Any, *, what: str = "key") -> None:
    """Set `a.b.c` to `value` in a nested dict, making the sections on the way."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{what}: {_show(part)} is not a section")
    node[parts[-1]] = value


def dump_yaml(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False), encoding="utf-8")


def _suggest(key: Any, known: Sequence[str] | dict[str, Any]) -> str:
    names = sorted(known)
    return f"{did_you_mean(key, names)} (known: {', '.join(names)})"


MAX_FREEFORM_DEPTH = 8
"""Deepest nesting of lists and mappings inside a free-form field (`task.options`, a comparison's
`variants`). Those hold a loader's keyword options: scalars, a list of names, at most a mapping of
lists (3 levels); 8 leaves room and stops a value that only a hostile or broken config would build."""

MAX_FREEFORM_NODES = 10_000
"""Most values (scalars, lists and mappings, each counted once per place it appears) in one free-form
field. The largest real option is a list of a few hundred names or numbers; 10,000 keeps every copy
(`dataclasses.asdict`, `copy.deepcopy`, one per comparison run) and every save of the config under a
millisecond and a megabyte, and the count stops there, so a value built in code that shares one list
a billion times over (what a YAML alias bomb builds) is refused after 10,000 steps, not expanded."""


def check_freeform(value: Any, name: str, *, max_depth: int = MAX_FREEFORM_DEPTH, max_nodes: int = MAX_FREEFORM_NODES) -> None:
    """FieldError unless `value` (a free-form field's data) nests at most `max_depth` lists and
    mappings deep and holds at most `max_nodes` values in all; the error names the first place
    over a bound (`task.options.a[0][0]...`). Iterative, and stops at the bound, so a value that
    holds itself or shares a list a billion times over costs `max_nodes` steps at most."""
    nodes = 1
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(value, 0, ())]  # (item, depth, path from `value`)
    while stack:
        item, depth, path = stack.pop()
        if not isinstance(item, (dict, list, tuple, set, frozenset)):
            continue
        if depth >= max_depth:
            where = name + "".join(f".{p[:40]}" if isinstance(p, str) else f"[{_show(p)}]" for p in path)
            raise FieldError(where, item, f"lists and mappings nested at most {max_depth} deep")
        for key, child in item.items() if isinstance(item, dict) else enumerate(item):
            nodes += 1  # counted when found, so a list of a billion items stops after max_nodes of them
            if nodes > max_nodes:
                raise FieldError(name, value, f"at most {max_nodes} values in all (lists, mappings and what they hold)")
            stack.append((child, depth + 1, (*path, key)))


_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent form without a dot (`1e-4`, `5E3`), which YAML 1.1 leaves a string."""


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=key + ".")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            hint_text = did_you_mean(value, [str(a) for a in allowed])
            raise ConfigError(f"{key}={_show(value)} is not accepted{hint_text} (accepted: {', '.join(map(str, allowed))})")
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
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}={_show(value)} fits none of {hint}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {_show(value)}")
        (item_hint, *_rest) = typing.get_args(hint) or (Any,)
        items = [_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {_show(value)}")
        check_freeform(value, key)  # a free-form mapping is copied and printed whole: bounded before it is kept
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {_show(value)}")
        return value
    if hint is float:  # every float field of every section: NaN and ±inf are never a setting
        if isinstance(value, str) and len(value) <= 100 and _YAML11_EXPONENT.fullmatch(value.strip()):  # the regex backtracks: quadratic in the length
            value = float(value)  # `1e-4`: YAML 1.1 (PyYAML) reads it as a string, everyone means a number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {_show(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {_show(value)}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {_show(value)}")
        return value
    raise ConfigError(f"{key}: unsupported field type {hint!r}")


# ---------------------------------------------------------------- the run config
# Sections that belong to one component are declared beside it (RolloutConfig in rollout/collector.py,
# PredictorConfig in predictor/hashed.py, SFTConfig in training/sft.py, TrainConfig in
# training/trainer.py); the run-level ones are here.


@dataclass
class ModelConfig:
    """Which policy and where it runs (how it generates: `EngineConfig`)."""

    name: str = "tiny"
    """`tiny`, `smollm2-135m`, a local Hugging Face model folder, or a hub id (with `download`)."""
    download: bool = False
    """Let transformers download a hub id `name` (needs the network). Off, a name that is neither a
    preset nor a local model folder is refused when the config loads, instead of retrying a hub."""
    warm_start: bool = True
    """Fine-tune on scripted demonstrations first (cached by config hash); see `sft`."""
    split_digits: bool = False
    """`tiny` only: its tokenizer writes every digit as its own token, so a number is the same tokens in
    a question, a thought and a tool reply (on `toolmath` it did not lift the warm start:
    docs/results/warm_start_toolmath); off, the BPE merges frequent numbers, as every result so far."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the attention projections (`trace_rl.models.LoraSpec`, peft): RL
    trains only them, so a real LM's update and optimiser state stay small on a CPU. 0: every weight
    trains. The warm start, if any, trains every weight before the adapters are added."""
    lora_alpha: int = 16
    """LoRA scale numerator (the adapters' output is scaled by alpha / rank)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the RL policy's weights are loaded in (the update and the `hf` engine share them)."""
    device: str = "cpu"
    """Torch device of the policy (`cpu`, `cuda`, `cuda:<index>` or `mps`); checked to exist when the config loads."""
    cpu_threads: int = 1
    """torch CPU threads (decoding, update, evaluation; the warm start always uses every core). One does
    not collapse when other jobs share the cores, as busy-waiting worker threads do (`compare` with
    `workers` > 1); on an idle machine more are faster, even for the tiny model: on 2 cores, 2 threads
    made the demo's step 1.6x faster than 1 (decoding 1.7x, the update 1.7x; `benchmarks/step_speed.py`)."""

    def __post_init__(self) -> None:
        if self.name == "tiny" and not self.warm_start:
            raise FieldError("warm_start", self.warm_start, "true with name=tiny (an untrained tiny model cannot use the tools)")
        if self.split_digits and self.name != "tiny":
            raise FieldError("split_digits", self.split_digits, "false unless name=tiny (other models bring their own tokenizer)")
        check_range(self, "cpu_threads", ge=1)
        check_range(self, "lora_rank", ge=0, le=4096, why="0: no adapters, every weight trains")
        check_range(self, "lora_alpha", ge=1)


@dataclass
class EngineConfig:
    """How the policy generates: transformers in this process (`hf`) or OpenAI-compatible servers
    (`openai`, vLLM / SGLang), and how the servers get the trainer's weights."""

    name: Literal["hf", "openai"] = "hf"
    """`hf`: transformers in this process; `openai`: vLLM / SGLang servers at `server_urls`."""
    server_urls: list[str] = field(default_factory=list)
    """Base URLs of the OpenAI-compatible servers of `engine: openai` (a bare `http://host:port` gets `/v1`);
    each tree's requests go to one of them, so its branches share that server's prefix cache."""
    server_timeout_s: float = 600.0
    """Deadline for one attempt at a server request, from connecting to the reply's last byte."""
    server_retries: int = 2
    """Retries of a request that failed in a way that may pass (connection lost, deadline, 429, 5xx)."""
    server_retry_wait_s: float = 1.0
    """Wait before the first retry; it doubles for each next one."""
    weight_sync: Literal["none", "vllm", "sglang"] = "none"
    """How the trainer's new weights reach the servers of `name: openai` after every update: written
    to `weight_dir` as a Hugging Face checkpoint, then `vllm` asks each vLLM server to reload them
    (`POST /collective_rpc` `reload_weights`, then `/reset_prefix_cache`; the server needs
    `VLLM_SERVER_DEV_MODE=1`, as `scripts/vllm_cpu_server.sh` sets) and `sglang` each SGLang server
    (`POST /update_weights_from_disk`). `none`: the servers keep their weights, so `name: openai`
    can sample and evaluate but not train."""
    weight_dir: str | None = None
    """Folder the servers can read where pushed weights are written (one checkpoint, replaced at each
    push); None: a fresh temporary folder (the servers must run on this machine)."""
    max_batch_size: int = 64
    """Sequences the `hf` engine decodes together."""
    generation_precision: Literal["auto", "fp32", "bf16"] = "fp32"
    """Arithmetic of the `hf` engine's generation (`trace_rl.engine.decoder` for Llama-family models):
    `fp32`, the transformers forward's numbers to float rounding; `bf16`, about twice as fast for
    SmolLM2 on a CPU with native bf16 (AVX512-BF16 / AMX) or a GPU, its log-probs within about 0.05 of
    fp32's on average; `auto`, bf16 where the hardware runs it natively, else fp32. With bf16 the update
    recomputes the behaviour log-probs in its own precision before its first optimiser step
    (`actor/rollout_logprob_gap` logs how far the engine's were), so on-policy ratios stay at 1."""
    prefix_cache_mb: float = 1024.0
    """Memory the `hf` engine may keep for the KV caches of earlier turns and branches (0: none, every
    prompt is prefilled whole); emptied whenever the weights change."""

    def __post_init__(self) -> None:
        if self.name == "openai" and not self.server_urls:
            raise FieldError("name", self.name, "hf, or openai with server_urls naming its servers (e.g. ['http://127.0.0.1:8000'])")
        for index, url in enumerate(self.server_urls):
            if not isinstance(url, str) or not is_http_url(url):
                raise FieldError(f"server_urls[{index}]", url, "an http:// or https:// URL with a host")
        check_range(self, "server_timeout_s", gt=0, why="seconds")
        check_range(self, "server_retries", ge=0, le=100)
        check_range(self, "server_retry_wait_s", ge=0, le=3600, why="seconds")
        check_choice(self, "weight_sync", ("none", "vllm", "sglang"))
        if self.weight_sync != "none" and self.name != "openai":
            raise FieldError("weight_sync", self.weight_sync, "none with name hf (the hf engine shares the trainer's weights)")
        if self.weight_dir is not None and not str(self.weight_dir).strip():
            raise FieldError("weight_dir", self.weight_dir, "a folder path or null")
        check_range(self, "max_batch_size", ge=1)
        check_choice(self, "generation_precision", ("auto", "fp32", "bf16"))
        check_range(self, "prefix_cache_mb", ge=0, why="0: no prefix cache")


@dataclass
class SandboxConfig:
    """Where the `python` tool runs model-written code (`trace_rl.agent.sandbox`; docs/reliability.md, "The sandbox")."""

    isolation: Literal["auto", "bwrap", "rlimits"] = "auto"
    """`bwrap`: namespaces via bubblewrap; `rlimits`: the weaker fallback (resource limits and, as root,
    a uid of its own; no network or filesystem isolation); `auto`: bwrap when it works, else rlimits."""
    python: str | None = None
    """Interpreter the code runs with (None: this process's). As root without bubblewrap the fallback
    needs one that every user can run, such as /usr/bin/python3."""

    def __post_init__(self) -> None:
        if self.python is not None and not self.python.startswith("/"):
            raise FieldError("python", self.python, "an absolute path to an interpreter, or null")


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
    format: Literal["auto", "tag", "json"] = "auto"
    """ReAct turn format (`trace_rl.agent.protocol`): `tag`, Search-R1 style tags such as `<search>…</search>`;
    `json`, Qwen / Hermes style `<tool_call>` JSON; `auto`, the model's (`trace_rl.models.profiles`: json for
    the Qwen families, tag for the rest)."""
    few_shot: int | None = None
    """Worked examples shown before each question, as earlier turns of the chat: whole episodes of other
    train tasks, played by the task set's oracle or demonstrations (those tasks then leave RL's pool).
    They teach a pretrained model the turn format without a warm start. None: the model's profile
    when `model.warm_start` is false (2 for `smollm2-135m`), else 0; the profile's count is dropped, with
    a warning, for a task set with neither oracle nor demonstrations."""
    open_thought: bool | None = None
    """Open each of the model's turns with `<think>` (after the prompt and after every observation), so
    it continues a thought rather than choosing how to begin. None: the model's profile (true for
    `smollm2-135m`, which without it wrote prose after its first observation)."""
    max_turns: int = 5
    """Turns an episode may take; one that has not answered by then ends with reward 0."""
    topk: int = 2
    """Passages per search. Two keep the `multihop` oracle at 100% and make search results about 30%
    shorter than three (whole demonstrations and rollout contexts about 20%)."""
    max_observation_chars: int = 1500
    """A tool's reply longer than this is cut, with a marker saying how much was cut, so it cannot flood the context."""
    search_url: str | None = None
    """A Search-R1 / verl retrieval server instead of the local BM25 index."""
    seed: int = 0
    """Seed of the generated task world (independent of the run seed)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of the task set's loader (`load_taskset(name, **options)`), e.g. `{pool_size: 3000,
    max_terms: 4}` for `rg:chain_sum`, `{num_questions: 4000}` for `multihop`. Their names are checked
    against the loader's when the config loads (`trace_rl.agent.tasks.option_names`); their values
    when the tasks load, before any model."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    env: str | None = None
    """Your own `Env` (`trace_rl.Env`), for anything richer than ReAct tool use: a `module:function` or
    `path/file.py:function` that returns one, called with the task set it runs (`make_env(taskset) ->
    Env`) in every process that builds an env. The collector calls only the protocol's methods and
    `max_turns`. None: the bundled `ToolEnv` (`format`, `max_turns`, `topk`, `max_observation_chars`,
    `search_url` and `sandbox` configure it, and do nothing for an env of your own)."""

    def __post_init__(self) -> None:
        """Ranges and sizes only: whether `name` names a task set, and `options` its loader's options, is
        checked by the run config, which can ask the loaders."""
        if self.env is not None and not (is_reference(self.env)):
            raise FieldError("env", self.env, "null or a module:function / path/file.py:function that returns your Env")
        if not isinstance(self.options, dict):
            raise FieldError("options", self.options, "a mapping of a task loader's options")
        check_freeform(self.options, "options")  # also here: a config built in code skips from_dict
        for key in self.options:
            if not isinstance(key, str):
                raise FieldError("options", self.options, f"a mapping with option names for keys, not {_show(key)}")
        for name in ("train_tasks", "demo_tasks", "test_tasks"):
            check_range(self, name, ge=1, nullable=True)
        check_range(self, "few_shot", ge=0, le=8, nullable=True, why="null: the model's profile")
        check_range(self, "max_turns", ge=1)
        check_range(self, "topk", ge=1)
        check_range(self, "max_observation_chars", ge=1)
        if self.search_url is not None and not is_http_url(self.search_url):
            raise FieldError("search_url", self.search_url, "an http:// or https:// URL with a host, or null")
        check_range(self, "seed", ge=0, le=MAX_SEED)
