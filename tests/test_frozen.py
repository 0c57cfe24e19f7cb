"""gpuwatch.frozen.quick: the quicker __init__ of the dataclasses built at every poll does what the dataclass's did."""

import dataclasses
import inspect
import pickle

import pytest

import gpuwatch.model  # noqa: F401 - every quick class registered
from gpuwatch.frozen import REPLACED, quick


def test_the_samples_readings_and_states_are_quick():
    from gpuwatch.groups import FastSample
    from gpuwatch.groups.clocks import Clocks
    from gpuwatch.groups.power import Power
    from gpuwatch.groups.thermal import Temperatures
    from gpuwatch.model import GpuState

    assert {FastSample, GpuState, Temperatures, Power, Clocks} <= REPLACED.keys()


def _by_original(cls, *args, **kwargs):
    made = object.__new__(cls)
    REPLACED[cls](made, *args, **kwargs)
    return made


def _fields(obj):
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


@pytest.mark.parametrize("cls", sorted(REPLACED, key=lambda c: c.__qualname__), ids=lambda c: c.__qualname__)
def test_quick_init_is_the_dataclass_init(cls):
    fields = dataclasses.fields(cls)
    assert inspect.signature(cls.__init__) == inspect.signature(REPLACED[cls])
    assert cls.__init__.__qualname__ == REPLACED[cls].__qualname__
    values = [object() for _ in fields]
    by_name = {f.name: v for f, v in zip(fields, values)}
    for made in (cls(*values), cls(**by_name), dataclasses.replace(cls(*values))):
        assert all(a is b for a, b in zip(_fields(made), values))
    required = {f.name: object() for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    a, b, original = cls(**required), cls(**required), _by_original(cls, **required)
    assert _fields(a) == _fields(original) and a == original
    for f in fields:
        if f.default_factory is not dataclasses.MISSING:  # a new one each time, as the dataclass makes it
            assert getattr(a, f.name) is not getattr(b, f.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(a, fields[0].name, 1)
    if not required:
        assert pickle.loads(pickle.dumps(a)) == a
    for args, kwargs in (((*values, 1), {}), ((), {**by_name, "unknown": 1}), ((), {})):
        if not required and not kwargs.get("unknown") and len(args) <= len(fields):
            continue  # nothing to refuse
        with pytest.raises(TypeError) as quick_error:
            cls(*args, **kwargs)
        with pytest.raises(TypeError) as dataclass_error:
            _by_original(cls, *args, **kwargs)
        assert str(quick_error.value) == str(dataclass_error.value)


def test_quick_takes_only_frozen_slots_dataclasses_without_post_init():
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int = 0

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int = 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        a: int = 0

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class NotInInit:
        a: int = 0
        b: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int = 0

    for cls in (NoSlots, NotFrozen, PostInit, NotInInit, KeywordOnly):
        with pytest.raises(TypeError):
            quick(cls)
