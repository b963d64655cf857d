"""The wire form every record shares: a versioned msgpack map, checked on decode.

Each record is a frozen dataclass with ``to_wire() -> bytes`` and ``from_wire(bytes)``.
The wire form is a msgpack map with string keys (never pickle). ``from_wire`` checks
size, types and ranges, ignores unknown fields (so newer peers can add some) and
rejects a newer *major* schema version. Every record stays far below hivemind's
~32 KiB DHT value limit: ``MAX_RECORD_BYTES`` is enforced on both ends, and it keeps a
whole store request (record + signed subkey + framing) under the 4 KiB that hivemind's
DHT process can read from its pipe in one piece (larger requests can be torn and hang).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NoReturn, TypeVar, get_type_hints

import msgpack

from fusionp2p.errors import RecordError

__all__ = ["MAX_RECORD_BYTES", "WireRecord", "unpack_body"]

MAX_RECORD_BYTES = 2048
_MAX_LIST = 16
_MAX_STRS = 64  # a list of strings: multiaddrs, the consumer nodes of an OpData
_MAX_INTS = 128  # node ranges of a plan stage; a tensor shape
_MAX_STR = 256

R = TypeVar("R", bound="WireRecord")


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


Checker = Callable[[Any], Any]


def _checker(name: str, annotation: Any) -> Checker:
    """A function that checks one decoded field against its annotation and returns the
    normalized value (built once per field: decoding runs for every message)."""
    origin = getattr(annotation, "__origin__", None)

    def fail(what: str, value: Any) -> NoReturn:
        raise RecordError(f"field {name!r} must be {what}, got {value!r:.80}")

    if annotation is str:

        def check_str(value: Any) -> Any:
            if value.__class__ is not str or len(value) > _MAX_STR:
                fail(f"a string of <= {_MAX_STR} chars", value)
            return value

        return check_str
    if annotation is bool:

        def check_bool(value: Any) -> Any:
            if value.__class__ is not bool:
                fail("a boolean", value)
            return value

        return check_bool
    if annotation is bytes:

        def check_bytes(value: Any) -> Any:
            if value.__class__ is not bytes or len(value) > MAX_RECORD_BYTES:
                fail(f"bytes of <= {MAX_RECORD_BYTES}", value)
            return value

        return check_bytes
    if annotation is int:

        def check_int(value: Any) -> Any:
            if value.__class__ is not int:
                fail("an integer", value)
            return value

        return check_int
    if annotation is float:

        def check_float(value: Any) -> Any:
            if value.__class__ not in (int, float) or not math.isfinite(value):
                fail("a finite number", value)
            return float(value)

        return check_float
    if origin is tuple:
        item_type = annotation.__args__[0]
        limit = _MAX_STRS if item_type is str else _MAX_INTS
        item = _checker(f"{name}[]", item_type)

        def check_tuple(value: Any) -> Any:
            if value.__class__ not in (list, tuple) or len(value) > limit:
                fail(f"a list of <= {limit} items", value)
            return tuple(item(v) for v in value)

        return check_tuple
    if origin is dict:
        key, item = _checker(f"{name} key", str), _checker(f"{name}[]", float)

        def check_dict(value: Any) -> Any:
            if value.__class__ is not dict or len(value) > _MAX_LIST:
                fail(f"a map of <= {_MAX_LIST} items", value)
            return {key(k): item(v) for k, v in value.items()}

        return check_dict
    raise TypeError(f"unsupported annotation {annotation!r} for {name}")  # a bug here, not input


@functools.cache
def _checkers(cls: type) -> tuple[tuple[str, Checker], ...]:
    """(field name, checker) of a record class, in declaration order (``get_type_hints`` is
    slow: resolved once per class)."""
    hints = get_type_hints(cls)
    return tuple((f.name, _checker(f.name, hints[f.name])) for f in fields(cls))


@dataclass(frozen=True)
class WireRecord:
    """Shared encode/decode for records; subclasses set ``KIND`` and declare fields."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1  # major schema version; minor additions are new optional fields

    def to_wire(self) -> bytes:
        """Encodes the record; raises RecordError if it would exceed MAX_RECORD_BYTES."""
        body = {"kind": self.KIND, "v": self.VERSION}
        for name in _field_names(type(self)):  # type: ignore[arg-type]  # shallow: no deep copy
            body[name] = getattr(self, name)
        data = msgpack.packb(body, use_bin_type=True)
        if len(data) > MAX_RECORD_BYTES:
            raise RecordError(f"{self.KIND} record is {len(data)} bytes > {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def from_wire(cls: type[R], data: bytes) -> R:
        """Decodes and validates a record of this class.

        Raises:
            RecordError: oversized, not msgpack, wrong kind, newer major version,
                a missing required field or a field of the wrong type or range.
        """
        body = unpack_body(data)
        if not isinstance(body.get("kind"), str) or body["kind"] != cls.KIND:
            raise RecordError(f"expected a {cls.KIND!r} record, got kind {body.get('kind')!r:.40}")
        return cls.from_body(body)

    @classmethod
    def from_dict(cls: type[R], fields_: dict[str, Any]) -> R:
        """Validates a plain dict of fields (e.g. from ``fusionp2p status --json``)."""
        return cls.from_body({"v": cls.VERSION, **fields_})

    @classmethod
    def from_body(cls: type[R], body: dict[str, Any]) -> R:
        version = body.get("v")
        if not isinstance(version, int) or version < 1:
            raise RecordError(f"{cls.KIND} record has no valid version, got {version!r:.40}")
        if version > cls.VERSION:
            raise RecordError(f"{cls.KIND} record version {version} is newer than {cls.VERSION}")
        kwargs = {}
        for name, check in _checkers(cls):  # type: ignore[arg-type]
            if name in body:
                kwargs[name] = check(body[name])
        try:
            return cls(**kwargs)
        except (TypeError, ValueError, OverflowError) as e:
            raise RecordError(f"{cls.KIND} record misses a field or has a bad one: {e}") from e


def unpack_body(data: bytes | bytearray) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray)):
        raise RecordError(f"a record must be bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(data)} bytes exceeds the limit of {MAX_RECORD_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise RecordError(f"record is not valid msgpack: {e}") from e
    if not isinstance(body, dict):
        raise RecordError(f"record must be a map, got {type(body).__name__}")
    return body
