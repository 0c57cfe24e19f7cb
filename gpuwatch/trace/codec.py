"""The trace codec: model objects to JSON-ready values and back, driven by the dataclasses' own fields.

No table lists the readings: a sample's fields are the reading groups' fields (gpuwatch/groups/),
stored flat by name (``temperature_celsius``, ``ecc_errors``...), and each field's codec follows from
its type annotation: numbers, whole numbers, booleans and strings; mappings with string keys as JSON
objects; mappings with (str, str) keys as objects with "first/second" keys; tuples of dataclasses
(fans, processes) as lists of objects, whose fields without a default are required. ``None``
readings and empty mappings or tuples are left out, so "absent" in a file means exactly "not
supported" in the sample. A new reading is recorded and replayed without a line here.

A codec's ``encode`` takes a non-empty model value and returns a JSON value (ValueError for what
JSON cannot hold: NaN, infinity); ``decode`` takes a JSON value and the field's name and returns the
model value (ReplayFormatError saying what is wrong).

A trace is input from anywhere (edited, corrupted, another version), so a decoded value is one the
live backend could have produced: numbers are finite floats (``json`` reads a 400-digit integer,
which no float holds), whole numbers are NVML's counts, sizes, ids and enums, 0..MAX_COUNT (as
``groups.base.whole`` keeps them), or a narrower range where the reading documents one
(``INT_RANGES``). Anything else is refused like a wrong type, naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from gpuwatch import groups
from gpuwatch.errors import ReplayFormatError
from gpuwatch.groups.base import MAX_COUNT
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, GpuIdentity, SlowSample

#: Separator of the two parts of a tuple key (ecc_errors: ("uncorrected", "volatile")).
KEY_SEPARATOR = "/"
#: Sample fields a trace does not keep: the recording host's own bookkeeping, not readings.
NOT_RECORDED = ("collected",)
#: Whole-number readings with a narrower range than 0..MAX_COUNT, by flat name: the largest value.
INT_RANGES: Mapping[str, int] = {"performance_state": 15}  # P0-P15 (groups/power.py)


@dataclass(frozen=True, slots=True)
class Codec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any, str], Any]
    kind: str  # what the docs call it, for messages


def describe(value: Any) -> str:
    try:
        text = json.dumps(value, default=repr)
    except (RecursionError, ValueError):  # a list nested nearly as deep as json.loads allows
        text = "[...]" if isinstance(value, list) else "{...}" if isinstance(value, dict) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def bad(name: str, expected: str, value: Any) -> ReplayFormatError:
    return ReplayFormatError(f"field {name!r}: expected {expected}, got {describe(value)}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encode_float(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{number} cannot be recorded: readings must be finite numbers")
    return number


def decode_float(value: Any, name: str) -> float:
    if isinstance(value, float) and math.isfinite(value):
        return value
    # compared as ints, exactly: math.isfinite(10**400) raises OverflowError, float() too
    if is_int(value) and -sys.float_info.max <= value <= sys.float_info.max:
        return float(value)
    raise bad(name, "a number", value)


def whole_number(maximum: int = MAX_COUNT) -> Codec:
    """The codec of a whole-number reading 0..maximum; out of range it is refused both ways (a recorder
    never writes what a reader refuses)."""
    expected = f"a whole number 0..{maximum}"

    def encode(value: Any) -> int:
        if not is_int(value) or not 0 <= value <= maximum:
            raise ValueError(f"{value!r} is not {expected}")
        return int(value)

    def decode(value: Any, name: str) -> int:
        if is_int(value) and 0 <= value <= maximum:
            return int(value)
        raise bad(name, expected, value)

    return Codec(encode, decode, "whole number")


def _decode_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise bad(name, "true or false", value)


def _decode_str(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    raise bad(name, "a string", value)


FLOAT = Codec(encode_float, decode_float, "number")
INT = whole_number()
encode_int = INT.encode
BOOL = Codec(bool, _decode_bool, "true/false")
STR = Codec(str, _decode_str, "string")


def _mapping(value_codec: Codec) -> Codec:
    """A mapping with string keys, as a JSON object."""

    def encode(mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {str(key): value_codec.encode(value) for key, value in mapping.items()}

    def decode(value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise bad(name, f"an object of {value_codec.kind}s", value)
        return {key: value_codec.decode(item, f"{name}.{key}") for key, item in value.items()}

    return Codec(encode, decode, f"object of {value_codec.kind}s")


def _pair_mapping(value_codec: Codec) -> Codec:
    """A mapping with (str, str) keys, as a JSON object with "first/second" keys."""

    def encode(mapping: Mapping[tuple[str, str], Any]) -> dict[str, Any]:
        result = {}
        for key, value in mapping.items():
            if len(key) != 2 or any(KEY_SEPARATOR in part or not part for part in key):
                raise ValueError(f"key {key!r} cannot be encoded as 'first{KEY_SEPARATOR}second'")
            result[KEY_SEPARATOR.join(key)] = value_codec.encode(value)
        return result

    def decode(value: Any, name: str) -> dict[tuple[str, str], Any]:
        if not isinstance(value, dict):
            raise bad(name, f"an object of {value_codec.kind}s", value)
        result = {}
        for key, item in value.items():
            parts = tuple(key.split(KEY_SEPARATOR))
            if len(parts) != 2 or not all(parts):
                raise ReplayFormatError(
                    f"field {name!r}: key {key!r} is not of the form 'first{KEY_SEPARATOR}second' "
                    f"(e.g. 'uncorrected{KEY_SEPARATOR}volatile')"
                )
            result[parts] = value_codec.decode(item, f"{name}.{key}")
        return result

    return Codec(encode, decode, f"object of {value_codec.kind}s")


def _strings() -> Codec:
    def decode(value: Any, name: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise bad(name, "a list of strings", value)
        return tuple(_decode_str(item, f"{name}[{i}]") for i, item in enumerate(value))

    return Codec(lambda value: [str(item) for item in value], decode, "list of strings")


def _objects(cls: type) -> Codec:
    """A tuple of dataclass objects (fans, processes), as a list of JSON objects."""
    noun = cls.__name__
    table = fields_of(cls)
    required = tuple(f.name for f in dataclasses.fields(cls)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    def encode(items: Any) -> list[dict[str, Any]]:
        return [encode_fields(item, table) for item in items]

    def decode(value: Any, name: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise bad(name, f"a list of {noun} objects", value)
        result = []
        for i, item in enumerate(value):
            where = f"{name}[{i}]"
            if not isinstance(item, dict):
                raise bad(where, f"a {noun} object", item)
            missing = [r for r in required if item.get(r) is None]
            if missing:
                raise ReplayFormatError(f"field {where!r}: missing {', '.join(repr(m) for m in missing)}")
            result.append(cls(**decode_fields(item, table, where + ".")))
        return tuple(result)

    return Codec(encode, decode, f"list of {noun} objects")


def codec_for(hint: Any) -> Codec:
    """The codec of a field from its type annotation (Optional is absence: None is never stored)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            return codec_for(kinds[0])
    if hint is float:
        return FLOAT
    if hint is bool:
        return BOOL
    if hint is int:
        return INT
    if hint is str:
        return STR
    if origin in (Mapping, dict, typing.Mapping):
        key, value = args
        if typing.get_origin(key) is tuple:
            return _pair_mapping(codec_for(value))
        return _mapping(codec_for(value))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] is str:
            return _strings()
        if dataclasses.is_dataclass(args[0]):
            return _objects(args[0])  # type: ignore[arg-type]
    raise TypeError(f"no trace codec for {hint!r}")


@functools.cache
def fields_of(cls: Any) -> dict[str, Codec]:
    """Field name -> codec of a dataclass, from its annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: codec_for(hints[f.name]) for f in dataclasses.fields(cls)}


def _sample_fields(container: type, flat: Mapping[str, tuple[str, str | None]]) -> dict[str, Codec]:
    """Flat reading name -> codec, for FastSample or SlowSample."""
    hints = typing.get_type_hints(container)
    table = {}
    for name, (attr, sub) in flat.items():
        if name in NOT_RECORDED:
            continue
        if name in INT_RANGES:
            table[name] = whole_number(INT_RANGES[name])
        elif sub is None:
            table[name] = codec_for(hints[attr])
        else:
            reading: Any = type(getattr(container(), attr))
            table[name] = fields_of(reading)[sub]
    return table


#: Flat field name -> codec of each tier's samples (every reading of every group, and ``errors``).
FAST_FIELDS: Mapping[str, Codec] = _sample_fields(FastSample, groups.FAST_FLAT)
SLOW_FIELDS: Mapping[str, Codec] = _sample_fields(SlowSample, groups.SLOW_FLAT)
DRIVER_FIELDS = ("driver_version", "nvml_version", "cuda_driver_version")


def encode_fields(obj: Any, table: Mapping[str, Codec], values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The non-empty fields of ``obj`` (or of ``values``, by name): None, empty mappings and empty
    tuples are left out."""
    result = {}
    for name, codec in table.items():
        value = values[name] if values is not None else getattr(obj, name)
        if value is None or (isinstance(value, (Mapping, tuple, list)) and not value):
            continue
        try:
            result[name] = codec.encode(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{type(obj).__name__}.{name}: {exc}") from None
    return result


def decode_fields(data: Mapping[str, Any], table: Mapping[str, Codec], prefix: str = "") -> dict[str, Any]:
    """Keyword arguments for the model class; keys not in ``table`` are ignored (compatibility)."""
    return {
        name: codec.decode(data[name], prefix + name)
        for name, codec in table.items()
        if name in data and data[name] is not None
    }


def need_object(data: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise ReplayFormatError(f"{what}: expected a JSON object, got {describe(data)}")
    return data


def encode_fast(sample: FastSample) -> dict[str, Any]:
    """The readings of a FastSample as a JSON-ready dict, flat by name (absent readings left out)."""
    return encode_fields(sample, FAST_FIELDS, groups.flat(sample))


def decode_fast(data: Mapping[str, Any]) -> FastSample:
    """The FastSample of a dict made by ``encode_fast``; other keys (``t``, ``uuid``...) are ignored."""
    return groups.fast_sample(**decode_fields(need_object(data, "fast sample"), FAST_FIELDS))


def encode_slow(sample: SlowSample) -> dict[str, Any]:
    """The readings of a SlowSample as a JSON-ready dict; ecc_errors keys become "error/counter"."""
    return encode_fields(sample, SLOW_FIELDS, groups.flat(sample))


def decode_slow(data: Mapping[str, Any]) -> SlowSample:
    return groups.slow_sample(**decode_fields(need_object(data, "slow sample"), SLOW_FIELDS))


_IDENTITY_REQUIRED = ("index", "uuid", "name", "pci_bus_id")


def encode_identity(identity: GpuIdentity) -> dict[str, Any]:
    return encode_fields(identity, fields_of(GpuIdentity))


def decode_identity(data: Mapping[str, Any]) -> GpuIdentity:
    data = need_object(data, "GPU identity")
    missing = [name for name in _IDENTITY_REQUIRED if data.get(name) is None]
    if missing:
        raise ReplayFormatError(f"GPU identity: missing {', '.join(repr(m) for m in missing)}")
    return GpuIdentity(**decode_fields(data, fields_of(GpuIdentity)))


def encode_gpu(gpu: DiscoveredGpu) -> dict[str, Any]:
    """A discovered GPU: its identity fields plus ``features`` (feature -> supported)."""
    result = encode_identity(gpu.identity)
    result["features"] = {str(name): bool(on) for name, on in gpu.features.items()}
    return result


def decode_gpu(data: Mapping[str, Any]) -> DiscoveredGpu:
    data = need_object(data, "GPU")
    identity = decode_identity(data)
    features = _mapping(BOOL).decode(data.get("features", {}), "features")
    return DiscoveredGpu(identity=identity, features=features)


def encode_driver(driver: DriverInfo) -> dict[str, Any]:
    return {name: str(getattr(driver, name)) for name in DRIVER_FIELDS}


def decode_driver(data: Any, name: str = "driver") -> DriverInfo:
    data = need_object(data, f"field {name!r}")
    missing = [f for f in DRIVER_FIELDS if f not in data]
    if missing:
        raise ReplayFormatError(f"field {name!r}: missing {', '.join(repr(m) for m in missing)}")
    return DriverInfo(**decode_fields(data, {f: STR for f in DRIVER_FIELDS}, name + "."))
