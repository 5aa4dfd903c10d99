"""Files written whole or not at all, and JSON read with errors that name the file.

A writer (:func:`atomic_directory`, :func:`atomic_file`) fills a hidden staging
sibling of its target, ``.<name>.partial-<id>``, and renames it into place only
when complete. On an exception or Ctrl-C the staging path is removed; a writer
killed outright (SIGKILL, power loss) leaves it behind, and the next write to the
same target removes it, with a :class:`LeftoverRemovedWarning`. While a writer
runs it holds an advisory lock (``flock``) on its staging path, so a leftover is
told apart from the staging path of a writer still at work.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

from models.errors import ModelError, ModelNotFoundError

_STAGING_INFIX = ".partial-"


class LeftoverRemovedWarning(UserWarning):
    """A staging path left by a killed writer was removed before writing the same target."""


def read_json(path) -> Any:
    """The parsed JSON of the file at ``path``.

    Raises:
        ModelNotFoundError: the file does not exist.
        ModelError: it is not UTF-8 text or not valid JSON (the message names the file).
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path} does not exist") from None
    except UnicodeDecodeError as err:
        raise ModelError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ModelError(f"{path}: cannot be read ({err.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelError(f"{path}: not valid JSON ({err})") from None


def staging_paths(target) -> list[pathlib.Path]:
    """The staging siblings of ``target`` that exist now (a writer's at work, or leftovers)."""
    target = pathlib.Path(target)
    if not target.parent.is_dir():
        return []
    return sorted(target.parent.glob(f".{_glob_escape(target.name)}{_STAGING_INFIX}*"))


@contextlib.contextmanager
def atomic_directory(target) -> Iterator[pathlib.Path]:
    """A staging directory that becomes ``target`` when the ``with`` block completes.

    Raises:
        FileExistsError: ``target`` exists, or another process is writing it.
    """
    with _staging(pathlib.Path(target), make=lambda p: p.mkdir()) as staging:
        yield staging


@contextlib.contextmanager
def atomic_file(target) -> Iterator[pathlib.Path]:
    """A staging file path that replaces ``target`` when the ``with`` block completes.

    Unlike :func:`atomic_directory`, an existing ``target`` is replaced (results files
    are rewritten run after run); readers see the old file or the new one, never a mix.

    Raises:
        FileExistsError: another process is writing ``target``.
    """
    with _staging(pathlib.Path(target), make=lambda p: p.touch(exist_ok=False), replace=True) as staging:
        yield staging


def write_text(target, text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` whole or not at all (:func:`atomic_file`)."""
    with atomic_file(target) as staging:
        staging.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def deferred_signals(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT / SIGTERM back during the block and deliver them when it ends.

    For work that cannot stop midway: orbax writes a checkpoint's arrays on its own
    threads, which go on writing after the main thread is interrupted. Only signals
    with a Python handler are held (a default SIGTERM still ends the process at
    once); outside the main thread the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for signum in signums:
        handler = signal.getsignal(signum)
        if callable(handler):
            previous[signum] = handler
            signal.signal(signum, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            previous[signum](signum, None)


@contextlib.contextmanager
def _staging(target: pathlib.Path, make, replace: bool = False) -> Iterator[pathlib.Path]:
    """Claim a locked staging path beside ``target``, yield it, rename it into place or remove it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging, lock = _claim(target, make, replace)
    try:
        try:
            yield staging
            if not replace and target.exists():  # appeared while we wrote
                raise FileExistsError(f"{target} already exists; choose a new path or remove it")
            os.replace(staging, target)
        except BaseException:
            with deferred_signals():  # a second Ctrl-C must not stop the clean-up halfway
                _remove(staging)
            raise
    finally:
        os.close(lock)


def _claim(target: pathlib.Path, make, replace: bool) -> tuple[pathlib.Path, int]:
    """(staging path, its lock fd): under a lock on the parent directory, so no writer sees
    another's staging path before it is locked, remove leftovers and create our own."""
    parent_fd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(parent_fd, fcntl.LOCK_EX)
        if not replace and target.exists():
            raise FileExistsError(f"{target} already exists; choose a new path or remove it")
        for leftover in staging_paths(target):
            _remove_if_abandoned(leftover, target)
        # A file's staging name ends in its suffix: writers that pick a format by the suffix
        # (matplotlib, numpy's savez) write the right one.
        suffix = target.suffix if replace else ""
        staging = target.parent / f".{target.name}{_STAGING_INFIX}{uuid.uuid4().hex[:12]}{suffix}"
        make(staging)
        lock = os.open(staging, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return staging, lock
    finally:
        os.close(parent_fd)


def _remove_if_abandoned(leftover: pathlib.Path, target: pathlib.Path) -> None:
    """Remove a staging path whose writer is gone (its lock is free); refuse if a writer holds it."""
    try:
        fd = os.open(leftover, os.O_RDONLY)
    except FileNotFoundError:  # its writer just finished or cleaned up
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FileExistsError(f"another process is writing {target} (staging at {leftover})") from None
    finally:
        os.close(fd)
    _remove(leftover)
    warnings.warn(f"removed {leftover}, left by an interrupted write of {target}", LeftoverRemovedWarning,
                  stacklevel=4)


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
