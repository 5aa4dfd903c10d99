"""The sparse methods by name: what ``jaxkv.generate(method=...)`` and ``jaxkv generate --method`` accept.

The built-in methods are registered here; :func:`register` adds another (a
:class:`~jaxkv.attention.method.SparseMethod`), see docs/adding_a_method.md.
"""
from __future__ import annotations

from jaxkv.attention import hybrid, magicpig, pariskv, pqcache, topk
from jaxkv.attention.method import SparseMethod

DENSE = "dense"  # not a sparse method: generate()'s dense path, never registered

_METHODS: dict[str, SparseMethod] = {
    "hybrid": hybrid.METHOD,
    "magicpig": magicpig.METHOD,
    "pariskv": pariskv.METHOD,
    "pqcache": pqcache.METHOD,
    "topk": topk.METHOD,
}


def register(name: str, method: SparseMethod) -> None:
    """Make ``method`` available as ``name``.

    Raises ValueError for a name already taken (or "dense"), for a method that is
    not a SparseMethod instance, and for a config class another method uses
    (:func:`for_config` must find one method per config class).
    """
    if not isinstance(method, SparseMethod):
        raise ValueError(f"register({name!r}): expected a SparseMethod instance, got {type(method).__name__}")
    if not isinstance(name, str) or not name or name == DENSE or name in _METHODS:
        raise ValueError(f"register({name!r}): the name is taken or empty; taken: {', '.join([DENSE, *_METHODS])}")
    clash = [other for other, m in _METHODS.items() if m.config_class is method.config_class]
    if clash:
        raise ValueError(f"register({name!r}): {method.config_class.__name__} is already the config of {clash[0]!r}")
    _METHODS[name] = method


def unregister(name: str) -> None:
    """Remove a method :func:`register` added (KeyError naming it if there is none)."""
    if name not in _METHODS:
        raise KeyError(f"no sparse method {name!r} is registered")
    del _METHODS[name]


def names() -> tuple[str, ...]:
    """The registered methods' names, sorted."""
    return tuple(sorted(_METHODS))


def get(name: str) -> SparseMethod:
    """The method registered as ``name``; ValueError listing the choices otherwise."""
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {DENSE}, {', '.join(names())}")
    return _METHODS[name]


def for_config(cfg) -> SparseMethod:
    """The registered method whose config class ``cfg`` is an instance of."""
    for method in _METHODS.values():
        if type(cfg) is method.config_class:
            return method
    raise ValueError(f"no registered sparse method takes a {type(cfg).__name__}; "
                     f"their configs: {', '.join(m.config_class.__name__ for m in _METHODS.values())}")
