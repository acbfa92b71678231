"""Frozen dataclasses <-> JSON, strictly: the one parser for manifests and build records.

``parse`` checks a JSON value against a dataclass's annotations and collects *every* problem
(unknown field, missing field, wrong type, a ``pattern``/``minimum`` from the field's metadata)
as one line each, so a caller can refuse with the whole list at once. ``to_json_value`` is the
inverse; optional fields (default ``None``) that are ``None`` are left out, so adding one keeps
the files that do not use it byte-identical.

Standard library only: this module runs on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from enum import StrEnum
from typing import Any

SCHEMA_TYPES: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    Any: {},
}


def json_type(value: Any) -> str:
    """The JSON name of a Python value's type, for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )


def optional(f: dataclasses.Field) -> bool:
    """A field with a None default: it may be absent, and is left out when None."""
    return f.default is None


def parse(tp: Any, value: Any, where: str, issues: list[str]) -> Any:
    """Convert ``value`` to ``tp``, appending a message per problem; None when it cannot."""
    here = where or "the document"
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            issues.append(f"{here}: expected an object, got {json_type(value)}")
            return None
        return _parse_object(tp, value, where, issues)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return parse(args[0], value, where, issues)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        try:
            return tp(value)
        except ValueError:
            known = ", ".join(repr(m.value) for m in tp)
            issues.append(f"{here}: {value!r} is not one of {known}")
            return None
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            issues.append(f"{here}: {value!r} is not one of {', '.join(map(repr, allowed))}")
            return None
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            issues.append(f"{here}: expected an array, got {json_type(value)}")
            return None
        return [parse(item_tp, v, f"{where}[{i}]", issues) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            issues.append(f"{here}: expected an object, got {json_type(value)}")
            return None
        _, value_tp = typing.get_args(tp)
        if value_tp is Any:
            return value
        return {str(k): parse(value_tp, v, f"{where}.{k}", issues) for k, v in value.items()}
    if tp is Any:
        return value
    ok = {
        str: isinstance(value, str),
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
    }.get(tp, isinstance(value, tp))
    if not ok:
        expected = SCHEMA_TYPES.get(tp, {}).get("type", getattr(tp, "__name__", str(tp)))
        issues.append(f"{here}: expected {expected}, got {json_type(value)} {value!r}")
        return None
    return float(value) if tp is float else value


@functools.cache
def _type_hints(cls: Any) -> dict[str, Any]:
    """A dataclass's resolved field types, once per class: resolving them is most of the time
    a record takes to parse."""
    return typing.get_type_hints(cls)


def _parse_object(cls: Any, table: dict[str, Any], where: str, issues: list[str]) -> Any:
    hints = _type_hints(cls)
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    prefix = f"{where}." if where else ""
    for key in table:
        if key not in names:
            issues.append(f"{prefix}{key}: unknown field (known: {', '.join(sorted(names))})")
    values: dict[str, Any] = {}
    complete = True
    for f in fields:
        if f.name not in table:
            if optional(f):
                values[f.name] = None
                continue
            issues.append(f"{prefix}{f.name}: missing field")
            complete = False
            continue
        before = len(issues)
        values[f.name] = parse(hints[f.name], table[f.name], f"{prefix}{f.name}", issues)
        if len(issues) > before:
            complete = False
            continue
        check_keywords(f, values[f.name], f"{prefix}{f.name}", issues)
    return cls(**values) if complete else None


def check_keywords(f: dataclasses.Field, value: Any, where: str, issues: list[str]) -> None:
    """The JSON Schema keywords declared on a field (pattern, minimum), checked here too."""
    pattern = f.metadata.get("pattern")
    if pattern and isinstance(value, str) and not re.fullmatch(pattern.strip("^$"), value):
        issues.append(f"{where}: {value!r} does not match {pattern}")
    minimum = f.metadata.get("minimum")
    if minimum is not None and isinstance(value, int) and value < minimum:
        issues.append(f"{where}: {value} is below the minimum {minimum}")


def to_json_value(value: Any) -> Any:
    """``dataclasses.asdict``, but optional fields that are None are left out and enums are
    written as their value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json_value(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (optional(f) and getattr(value, f.name) is None)
        }
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    return value


def schema_for(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema (2020-12) of an annotation; dataclasses go to ``defs`` by name."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # reserve the name before recursing
            defs[tp.__name__] = object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return {"anyOf": [schema_for(args[0], defs), {"type": "null"}]}
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return {"enum": [m.value for m in tp]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        return {"type": "array", "items": schema_for(typing.get_args(tp)[0], defs)}
    if origin is dict:
        _, value_tp = typing.get_args(tp)
        if value_tp is Any:
            return {"type": "object"}
        return {"type": "object", "additionalProperties": schema_for(value_tp, defs)}
    return dict(SCHEMA_TYPES[tp])


def object_schema(cls: Any, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties = {}
    for f in dataclasses.fields(cls):
        prop = schema_for(hints[f.name], defs)
        prop.update(dict(f.metadata.items()))
        properties[f.name] = prop
    schema: dict[str, Any] = {"type": "object"}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    schema.update(
        properties=properties,
        required=[f.name for f in dataclasses.fields(cls) if not optional(f)],
        additionalProperties=False,
    )
    return schema
