"""A quicker ``__init__`` for the frozen slots dataclasses that every poll builds for every GPU.

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__(self, name, value)`` (the
class's own ``__setattr__`` refuses): about 0.1 µs a field. A fast poll builds some 55 fields a GPU (the groups'
readings, the FastSample, the GPU's state in the store, the rules' copy for their look-back): at 64 GPUs a tenth
of the poll's CPU. ``quick`` gives such a class an ``__init__`` of the same signature (parameters, defaults,
default factories, the same sentinel) that sets each slot through the slot's own descriptor, which is what
``object.__setattr__`` ends up calling: half the cost. Nothing else of the class changes: it is frozen, compared,
hashed, pickled and copied by ``dataclasses.replace`` (which calls this ``__init__``) as before.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

REPLACED: dict[type, Callable[..., None]] = {}  # class -> the dataclass's own __init__ (tests/test_frozen.py)


def quick(cls: type[T]) -> type[T]:
    """``cls`` (a frozen dataclass with ``slots=True``, every field an ``__init__`` parameter, no
    ``__post_init__``) with the quicker ``__init__``; TypeError for any other class."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    params_ok = [p.name for p in params] == [f.name for f in fields] and all(
        p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    slots_ok = all(isinstance(cls.__dict__.get(f.name), types.MemberDescriptorType) for f in fields)
    frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    if not (params_ok and slots_ok and frozen) or hasattr(cls, "__post_init__"):
        raise TypeError(f"quick: {cls.__qualname__} is not a frozen slots dataclass whose fields are all "
                        "__init__ parameters, without __post_init__")
    space: dict[str, Any] = {}
    signature, body = [], []
    for i, (f, p) in enumerate(zip(fields, params)):
        space[f"__set{i}"] = cls.__dict__[f.name].__set__
        value = f.name
        if p.default is not inspect.Parameter.empty:
            space[f"__default{i}"] = p.default  # the field's default, or dataclasses' default-factory sentinel
            signature.append(f"{f.name}=__default{i}")
            if f.default_factory is not dataclasses.MISSING:
                space[f"__factory{i}"] = f.default_factory
                value = f"__factory{i}() if {f.name} is __default{i} else {f.name}"
        else:
            signature.append(f.name)
        body.append(f"    __set{i}(self, {value})\n")
    exec(f"def __init__(self, {', '.join(signature)}):\n{''.join(body) or '    pass'}\n", space)
    init = space["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    REPLACED[cls] = cls.__init__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
