"""Validation of configuration values: each value against its type annotation and its bounds.

Every frozen config dataclass (``ModelConfig``, the attention methods' configs,
``CacheConfig``, ``SamplingConfig``, ``DenseConfig``) calls :func:`check` from its
``__post_init__``, and ``generate()`` checks its arguments with :func:`check_value`.
An ``int`` is an int (not a bool, not 2.5), a ``float`` a finite real number, a
``tuple[int, ...]`` a tuple (or list) of ints; the error names ``Class.field``.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import types
import typing
from typing import Any

import numpy as np

# Seeds become JAX PRNG keys, which keep 32 bits of the seed unless jax_enable_x64 is
# on: larger seeds would silently collide with smaller ones.
SEED_LIMIT = 2**32 - 1


class FieldError(ValueError):
    """A configuration value outside its bounds.

    Attributes: ``owner`` (the config class name, or None for a plain argument),
    ``field``, ``value`` and ``expected`` (what the value must be, in words).
    """

    def __init__(self, owner: str | None, field: str, value: Any, expected: str):
        self.owner, self.field, self.value, self.expected = owner, field, value, expected
        label = f"{owner}.{field}" if owner else field
        super().__init__(f"{label} must be {expected}, got {_shown(value)}")


class FieldTypeError(FieldError, TypeError):
    """A configuration value of the wrong type (a ValueError too, like every config error)."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """An interval a number (or every element of a tuple) must lie in; None leaves a side open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value) -> bool:
        if isinstance(value, tuple):
            return all(self.holds(v) for v in value)
        if not isinstance(value, numbers.Real):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


@dataclasses.dataclass(frozen=True)
class OneOf:
    """A value that must be one of a few choices (e.g. a mode name)."""

    choices: tuple

    def holds(self, value) -> bool:
        return value in self.choices

    def __str__(self) -> str:
        return f"one of {self.choices}"


def at_least(low) -> Bound:
    return Bound(low=low)


def in_range(low, high, *, low_open: bool = False, high_open: bool = False) -> Bound:
    return Bound(low, high, low_open, high_open)


POSITIVE = Bound(low=0, low_open=True)
NON_NEGATIVE = Bound(low=0)
SEED = Bound(low=0, high=SEED_LIMIT)
FRACTION = Bound(low=0, high=1, low_open=True)  # (0, 1]

Rule = typing.Union[Bound, OneOf]


def check(config, **rules: Rule) -> None:
    """Check every field of the dataclass ``config`` against its annotation and ``rules[field]``.

    Values are normalised in place where the type allows it (a numpy int becomes an
    int, an int in a float field a float, a list in a tuple field a tuple), so equal
    configs hash equal as static arguments.

    Raises:
        FieldTypeError: a value of the wrong type (also a TypeError and a ValueError).
        FieldError: a value outside its rule (a ValueError).
    """
    owner = type(config).__name__
    hints = type_hints(type(config))
    unknown = set(rules) - set(hints)
    if unknown:
        raise KeyError(f"{owner} has no fields {sorted(unknown)} to check")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        checked = check_value(field.name, value, hints[field.name], rules.get(field.name), owner=owner)
        if checked is not value:
            object.__setattr__(config, field.name, checked)


def check_value(name: str, value, annotation, rule: Rule | None = None, *, owner: str | None = None):
    """``value`` checked against ``annotation`` (int, float, bool, str, tuple[...], unions, classes) and ``rule``.

    Returns:
        The value, normalised (see :func:`check`).
    """
    try:
        normalised = _coerce(value, annotation)
    except _WrongType:
        raise FieldTypeError(owner, name, value, describe(annotation, rule)) from None
    if rule is not None and normalised is not None and not rule.holds(normalised):
        raise FieldError(owner, name, value, str(rule))
    return normalised


@functools.cache
def type_hints(cls) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (cached per class)."""
    return typing.get_type_hints(cls)


def describe(annotation, rule: Rule | None = None) -> str:
    """What a value of ``annotation`` under ``rule`` must be, in words ("an int >= 1 or None")."""
    if isinstance(rule, OneOf):
        return str(rule)
    kinds = _union_members(annotation)
    words = [_describe_type(kind) for kind in kinds if kind is not type(None)]
    text = " or ".join(words) + (f" {rule}" if rule is not None else "")
    return text + (" or None" if type(None) in kinds else "")


class _WrongType(Exception):
    pass


def _union_members(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _describe_type(kind) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is bool:
        return "a bool"
    if kind is int:
        return "an int"
    if kind is float:
        return "a finite number"
    if kind is str:
        return "a str"
    if kind is Any:
        return "any value"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of " + ", ".join(str(member.value) for member in kind)
    if kind is tuple or origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float, str, bool):
            return f"a sequence of {args[0].__name__}s"
        return "a tuple"
    return f"a {getattr(kind, '__name__', str(kind))}"


def _coerce(value, kind):
    """``value`` as an instance of annotation ``kind``, or _WrongType."""
    members = _union_members(kind)
    if len(members) > 1:
        for member in members:
            try:
                return _coerce(value, member)
            except _WrongType:
                continue
        raise _WrongType
    if kind is Any:
        return value
    if kind is type(None):
        if value is None:
            return None
        raise _WrongType
    if kind is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise _WrongType
    if kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
            return value if type(value) is int else int(value)
        raise _WrongType
    if kind is float:
        return _finite_float(value)
    origin = typing.get_origin(kind)
    if kind is tuple or origin is tuple:
        return _coerce_tuple(value, typing.get_args(kind))
    if origin is not None:  # another generic (dict[...], ...): its origin's type only
        kind = origin
    if isinstance(kind, type) and not isinstance(value, kind):
        raise _WrongType
    return value


def _finite_float(value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise _WrongType
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise _WrongType from None
    if not math.isfinite(number):
        raise _WrongType
    return number


def _coerce_tuple(value, args: tuple) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise _WrongType
    if not args:
        return tuple(value)
    if len(args) == 2 and args[1] is Ellipsis:
        items = tuple(_coerce(v, args[0]) for v in value)
    elif len(args) == len(value):
        items = tuple(_coerce(v, a) for v, a in zip(value, args))
    else:
        raise _WrongType
    return value if isinstance(value, tuple) and all(a is b for a, b in zip(items, value)) else items


def _shown(value) -> str:
    """repr of a value for a message, cut short (a config value may be a huge list)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
