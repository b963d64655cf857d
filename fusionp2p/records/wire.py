"""The wire form every record shares: a versioned msgpack map, checked on decode.

Each record is a frozen dataclass with ``to_wire() -> bytes`` and ``from_wire(bytes)``.
The wire form is a msgpack map with string keys (never pickle): ``kind``, ``v`` (the
major version) and the fields. ``from_wire`` checks the size first, then every field
against its annotation, so a record is validated in one place and one way:

- ``str``, ``bytes``, ``bool``, ``int``, ``float`` (finite), ``tuple[X, ...]`` and fixed
  ``tuple[X, Y]``, ``dict[str, X]``, ``Any`` (a bounded JSON-like value), another record
  (a nested map with its own kind and version) or a plain config dataclass (a nested map
  of its fields);
- ``Annotated[X, Limit(n)]`` bounds the characters, bytes or items of a field (defaults
  below), ``Annotated[X, Range(low, high)]`` the value of a number.

Version rule: ``v`` is the *major* version, and it changes only for a breaking change (a
field removed, renamed or read differently). A new field is optional, with a default, and
needs no new version: decoders ignore fields they do not know, so an older peer reads a
newer record of the same major version. A record of a newer major version is refused with
one line. Every record has a byte limit (``MAX_BYTES``) enforced on both ends before
anything is unpacked; records stored in the DHT keep ``MAX_RECORD_BYTES``, which keeps a
whole store request under the 4 KiB hivemind's DHT process reads from its pipe in one
piece (larger requests can be torn and hang).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated, Any, ClassVar, NoReturn, TypeVar, get_args, get_origin, get_type_hints

import msgpack

from fusionp2p.errors import RecordError

__all__ = ["MAX_RECORD_BYTES", "Limit", "Range", "WireRecord", "unpack_body"]

MAX_RECORD_BYTES = 2048  # a record stored in the DHT
_MAX_MAP = 16  # items of a dict field
_MAX_STRS = 64  # a list of strings: multiaddrs, the consumer nodes of an OpData
_MAX_ITEMS = 128  # any other list: node ranges of a plan stage, a tensor shape
_MAX_STR = 256
_INT64 = 1 << 63
# a JSON-like value (a model config): how deep, how many items per container and in all
_JSON_DEPTH = 8
_JSON_ITEMS = 256
_JSON_NODES = 4096
_JSON_STR = 1024

R = TypeVar("R", bound="WireRecord")
Checker = Callable[[Any], Any]


@dataclass(frozen=True)
class Limit:
    """``Annotated`` metadata: the most characters (str), bytes (bytes) or items (tuple, dict)."""

    most: int


@dataclass(frozen=True)
class Range:
    """``Annotated`` metadata: a number's inclusive bounds."""

    low: float
    high: float


def _fail(name: str, what: str, value: Any) -> NoReturn:
    raise RecordError(f"field {name!r} must be {what}, got {value!r:.80}")


def _check_json(name: str, value: Any) -> Any:
    """``value`` if it is a bounded JSON-like tree (maps with string keys, lists, strings,
    finite numbers, booleans, None)."""
    nodes = 0

    def walk(item: Any, depth: int) -> Any:
        nonlocal nodes
        nodes += 1
        if nodes > _JSON_NODES or depth > _JSON_DEPTH:
            _fail(name, f"a JSON value of at most {_JSON_NODES} items and {_JSON_DEPTH} levels", "(larger)")
        kind = item.__class__
        if item is None or kind is bool:
            return item
        if kind is int:
            if not -_INT64 <= item < _INT64:
                _fail(name, "a JSON value with 64-bit integers", item)
            return item
        if kind is float:
            if not math.isfinite(item):
                _fail(name, "a JSON value with finite numbers", item)
            return item
        if kind is str:
            if len(item) > _JSON_STR:
                _fail(name, f"a JSON value with strings of at most {_JSON_STR} chars", item)
            return item
        if kind in (list, tuple):
            if len(item) > _JSON_ITEMS:
                _fail(name, f"a JSON value with lists of at most {_JSON_ITEMS} items", item)
            return [walk(v, depth + 1) for v in item]
        if kind is dict:
            if len(item) > _JSON_ITEMS or any(k.__class__ is not str or len(k) > _MAX_STR for k in item):
                _fail(name, f"a JSON value with maps of at most {_JSON_ITEMS} string keys", item)
            return {k: walk(v, depth + 1) for k, v in item.items()}
        _fail(name, "a JSON value", item)

    return walk(value, 0)


def _unwrap(annotation: Any) -> tuple[Any, int | None, Range | None]:
    """(the type, its Limit, its Range) of a possibly ``Annotated`` annotation."""
    if get_origin(annotation) is not Annotated:
        return annotation, None, None
    base, *meta = get_args(annotation)
    limit = next((m.most for m in meta if isinstance(m, Limit)), None)
    bounds = next((m for m in meta if isinstance(m, Range)), None)
    return base, limit, bounds


def _checker(name: str, annotation: Any) -> Checker:
    """A function that checks one decoded field against its annotation and returns the
    normalized value (built once per field: decoding runs for every message)."""
    kind, limit, bounds = _unwrap(annotation)
    origin = get_origin(kind)
    if kind is str:
        most = limit or _MAX_STR

        def check_str(value: Any) -> Any:
            if value.__class__ is not str or len(value) > most:
                _fail(name, f"a string of at most {most} chars", value)
            return value

        return check_str
    if kind is bool:

        def check_bool(value: Any) -> Any:
            if value.__class__ is not bool:
                _fail(name, "a boolean", value)
            return value

        return check_bool
    if kind is bytes:
        most = limit or MAX_RECORD_BYTES

        def check_bytes(value: Any) -> Any:
            if value.__class__ is not bytes or len(value) > most:
                _fail(name, f"at most {most} bytes", value)
            return value

        return check_bytes
    if kind is int:
        low, high = (int(bounds.low), int(bounds.high)) if bounds else (-_INT64, _INT64 - 1)

        def check_int(value: Any) -> Any:
            if value.__class__ is not int:
                _fail(name, "an integer", value)
            if not low <= value <= high:
                _fail(name, f"an integer in [{low}, {high}]", value)
            return value

        return check_int
    if kind is float:
        low_f, high_f = (bounds.low, bounds.high) if bounds else (-math.inf, math.inf)

        def check_float(value: Any) -> Any:
            if value.__class__ not in (int, float) or not math.isfinite(value):
                _fail(name, "a finite number", value)
            if not low_f <= value <= high_f:
                _fail(name, f"a number in [{low_f:g}, {high_f:g}]", value)
            return float(value)

        return check_float
    if kind is Any:
        return functools.partial(_check_json, name)
    if origin is tuple:
        return _tuple_checker(name, get_args(kind), limit)
    if origin is dict:
        most = limit or _MAX_MAP
        key, item = _checker(f"{name} key", str), _checker(f"{name}[]", get_args(kind)[1])

        def check_dict(value: Any) -> Any:
            if value.__class__ is not dict or len(value) > most:
                _fail(name, f"a map of at most {most} items", value)
            return {key(k): item(v) for k, v in value.items()}

        return check_dict
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return functools.partial(_decode_nested, name, kind)
    raise TypeError(f"unsupported annotation {annotation!r} for {name}")  # a bug here, not input


def _tuple_checker(name: str, args: tuple[Any, ...], limit: int | None) -> Checker:
    if len(args) == 2 and args[1] is Ellipsis:
        item_type = _unwrap(args[0])[0]
        most = limit or (_MAX_STRS if item_type is str else _MAX_ITEMS)
        item = _checker(f"{name}[]", args[0])

        def check_tuple(value: Any) -> Any:
            if value.__class__ not in (list, tuple) or len(value) > most:
                _fail(name, f"a list of at most {most} items", value)
            return tuple(item(v) for v in value)

        return check_tuple
    items = [_checker(f"{name}[{i}]", a) for i, a in enumerate(args)]

    def check_fixed(value: Any) -> Any:
        if value.__class__ not in (list, tuple) or len(value) != len(items):
            _fail(name, f"a list of {len(items)} items", value)
        return tuple(check(v) for check, v in zip(items, value, strict=True))

    return check_fixed


def _decode_nested(name: str, cls: type, value: Any) -> Any:
    """A nested record (with its kind and version) or config dataclass, from its map."""
    if value.__class__ is not dict:
        _fail(name, f"a {cls.__name__} map", value)
    try:
        if issubclass(cls, WireRecord):
            if value.get("kind") != cls.KIND:
                _fail(name, f"a {cls.KIND!r} record", value.get("kind"))
            return cls.from_body(value)
        return _construct(cls, value)
    except RecordError as e:
        raise RecordError(f"field {name!r}: {e}") from e


def _construct(cls: type[Any], body: dict[str, Any]) -> Any:
    kwargs = {name: check(body[name]) for name, check in _checkers(cls) if name in body}  # type: ignore[arg-type]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, OverflowError) as e:
        label = f"{cls.KIND} record" if issubclass(cls, WireRecord) else cls.__name__
        raise RecordError(f"{label} misses a field or has a bad one: {e}") from e


@functools.cache
def _checkers(cls: type) -> tuple[tuple[str, Checker], ...]:
    """(field name, checker) of a dataclass, in declaration order (``get_type_hints`` is
    slow: resolved once per class)."""
    hints = get_type_hints(cls, include_extras=True)
    return tuple((f.name, _checker(f.name, hints[f.name])) for f in fields(cls) if f.init)


def _encode(value: Any) -> Any:
    if isinstance(value, WireRecord):
        return value.to_body()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return [_encode(v) for v in value]
    return value


@functools.cache
def _nested_fields(cls: type) -> frozenset[str]:
    """Fields of ``cls`` whose values need ``_encode`` (records and dataclasses inside)."""
    out = set()
    for name, hint in get_type_hints(cls, include_extras=True).items():
        kind = _unwrap(hint)[0]
        args = get_args(kind) if get_origin(kind) is tuple else (kind,)
        if any(isinstance(_unwrap(a)[0], type) and dataclasses.is_dataclass(_unwrap(a)[0]) for a in args):
            out.add(name)
    return frozenset(out)


@dataclass(frozen=True)
class WireRecord:
    """Shared encode/decode for records; subclasses set ``KIND`` and declare fields."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1  # the major version: changes only for a breaking change
    MAX_BYTES: ClassVar[int] = MAX_RECORD_BYTES  # the most bytes its wire form may take

    def to_body(self) -> dict[str, Any]:
        """The record as a map (what ``to_wire`` packs)."""
        body: dict[str, Any] = {"kind": self.KIND, "v": self.VERSION}
        nested = _nested_fields(type(self))  # type: ignore[arg-type]
        for f in fields(self):
            value = getattr(self, f.name)
            body[f.name] = _encode(value) if f.name in nested else value  # shallow: no deep copy
        return body

    def to_wire(self) -> bytes:
        """Encodes the record; raises RecordError if it would exceed ``MAX_BYTES``."""
        data = msgpack.packb(self.to_body(), use_bin_type=True)
        if len(data) > self.MAX_BYTES:
            raise RecordError(f"{self.KIND} record is {len(data)} bytes > {self.MAX_BYTES}")
        return data

    @classmethod
    def from_wire(cls: type[R], data: bytes | bytearray | memoryview) -> R:
        """Decodes and validates a record of this class.

        Raises:
            RecordError: oversized, not msgpack, wrong kind, newer major version,
                a missing required field or a field of the wrong type or range.
        """
        body = unpack_body(data, limit=cls.MAX_BYTES)
        if not isinstance(body.get("kind"), str) or body["kind"] != cls.KIND:
            raise RecordError(f"expected a {cls.KIND!r} record, got kind {body.get('kind')!r:.40}")
        return cls.from_body(body)

    @classmethod
    def from_dict(cls: type[R], fields_: dict[str, Any]) -> R:
        """Validates a plain dict of fields (e.g. from ``fusionp2p status --json``)."""
        return cls.from_body({"v": cls.VERSION, **fields_})

    @classmethod
    def from_body(cls: type[R], body: dict[str, Any]) -> R:
        """Validates a decoded map (the ``kind`` is the caller's to check).

        Raises:
            RecordError: as ``from_wire``.
        """
        version = body.get("v")
        if version.__class__ is not int or version < 1:
            raise RecordError(f"{cls.KIND} record has no valid version, got {version!r:.40}")
        if version > cls.VERSION:
            raise RecordError(
                f"{cls.KIND} record of major version {version} is newer than {cls.VERSION}, the newest "
                "this peer reads (upgrade fusionp2p)"
            )
        return _construct(cls, body)


def unpack_body(data: bytes | bytearray | memoryview, *, limit: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """A record's map from its bytes, at most ``limit`` of them.

    Raises:
        RecordError: too large, not msgpack, or not a map.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError(f"a record must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise RecordError(f"record of {len(data)} bytes exceeds the limit of {limit}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise RecordError(f"record is not valid msgpack: {e}") from e
    if not isinstance(body, dict):
        raise RecordError(f"record must be a map, got {type(body).__name__}")
    return body
