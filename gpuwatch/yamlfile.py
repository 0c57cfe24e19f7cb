"""Reading a YAML file that a person wrote: every way it can be unreadable is one ConfigError.

Used for gpuwatch's own configuration file and the web configuration file. The message names the
file, says where (line and column) and what to do; it never ends in a traceback:

- the file cannot be opened or read (missing, a directory, permissions): the OS's reason;
- it is not UTF-8 (a latin-1 ``°`` in a comment): the first bad byte and where it is;
- it is not YAML, or nests deeper than any configuration needs: where the parser gave up;
- a key is given twice in one mapping (YAML would keep the last silently; exporter-toolkit's
  strict YAML refuses it, and so does gpuwatch);
- it holds a whole number of 2**63 or more (more than 4300 digits: Python refuses even to read it), or a
  date that is not one (``2026-13-45``);
- it holds more than 100,000 values once its aliases are expanded (a "billion laughs" of aliases
  to aliases: everything that walks, prints or validates the document would take hours).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from gpuwatch.errors import ConfigError

# PyYAML is imported at the first file read, not with gpuwatch: a node run from flags alone never loads
# it (about 2.5 MB of resident memory, issue 20).


@functools.cache
def _strict_loader() -> Any:
    """SafeLoader that refuses a key given twice."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def no_duplicates(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: construct_mapping reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, no_duplicates)
    return StrictLoader


def _not_utf8(raw: bytes, exc: UnicodeDecodeError) -> str:
    start = exc.start
    line = raw.count(b"\n", 0, start) + 1
    column = start - (raw.rfind(b"\n", 0, start) + 1) + 1
    return (f"is not UTF-8: byte 0x{raw[start]:02x} at line {line}, column {column} "
            f"(save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`)")


MAX_VALUES = 100_000  # a configuration has a few hundred at most
LARGEST = 2**63  # whole numbers at or beyond it are refused: no setting needs them, and float() or str() fails on some


def whole_number(value: int) -> str:
    """"a whole number of 400 digits": how a message names a number too long to show."""
    try:
        return f"a whole number of {len(str(abs(value)))} digits"
    except ValueError:  # more than 4300 digits: Python refuses to spell it
        return "a whole number of more than 4300 digits"


def _check_size(document: Any, where: str) -> None:
    """ConfigError when the document, its aliases expanded, holds more than MAX_VALUES values (the walk
    stops there, so an alias bomb costs MAX_VALUES steps, not its expansion) or a whole number beyond
    LARGEST either way (float() of a 400-digit one overflows, str() of a 5000-digit one is refused)."""
    stack, seen = [document], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ConfigError(f"{where} holds more than {MAX_VALUES} values once its aliases are expanded: "
                              "no configuration needs that (aliases that repeat aliases?)")
        if isinstance(value, int) and not -LARGEST < value < LARGEST:
            raise ConfigError(f"{where} holds {whole_number(value)}: no setting is that large (the largest is "
                              "below 2**63)")
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set)):
            stack.extend(value)


def parse_yaml(raw: bytes | str, where: str) -> Any:
    """The YAML document in ``raw``; ConfigError starting with ``where`` (e.g. "config file X") if it is not."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} {_not_utf8(raw, exc)}") from None
    else:
        text = raw
    import yaml

    try:
        document = yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{where} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise ConfigError(f"{where} nests too deeply to be a configuration file") from None
    except ValueError as exc:  # PyYAML's int() of more than 4300 digits, a date such as 2026-13-45
        what = ("a whole number of more than 4300 digits: no setting is that large"
                if "integer string conversion" in str(exc) else f"a value that is not what it looks like: {exc}")
        raise ConfigError(f"{where} holds {what}") from None
    _check_size(document, where)
    return document


def read_yaml(path: str | os.PathLike[str], what: str) -> Any:
    """Read and parse ``path``; ``what`` names the kind of file in messages ("config file")."""
    path = os.fspath(path)
    where = f"{what} {path}"
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    return parse_yaml(raw, where)
