"""C++ CPU kernels as XLA FFI custom calls: compiled on first use, cached, registered with ``jax.ffi``.

:class:`KernelLibrary` is one shared library: its sources are compiled with the
system C++ compiler (``$CXX``, else g++, else c++) against the XLA FFI headers that
ship with jaxlib, ``-march=native``, linked with glibc's vector math (libmvec), and
cached under ``$JAXKV_NATIVE_CACHE`` (default ``~/.cache/jaxkv/native``) by a digest of
the sources, headers, compiler command, CPU flags and JAX version. ``models.native``
(the quantised-weight products) and ``jaxkv.native`` (the attention kernels) are two.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

# What parallel.h's JAXKV_AVX512 needs: byte permutes and compresses, bit deposits, bit transposes.
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vbmi", "avx512_vbmi2", "bmi2", "gfni")
HEADER_DIR = pathlib.Path(__file__).parent  # parallel.h, shared by every library's sources


class NativeUnavailable(RuntimeError):
    """The CPU kernels could not be built or loaded here (the message says why)."""


def cxx_compiler() -> str:
    """The C++ compiler the kernels are built with: ``$CXX``, else g++, else c++."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeUnavailable("no C++ compiler found (set CXX)")
    return compiler


def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo (the processor's name where there is none)."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.startswith("flags")), platform.processor())


def _is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _compiler_errors(stderr: str, limit: int = 2000) -> str:
    """The compiler's error lines, at most ``limit`` characters (the last): its warnings about
    jaxlib's FFI headers run to pages and would push the errors out of a tail. All of its
    output when no line says error."""
    errors = [line for line in stderr.splitlines() if "error" in line]
    return ("\n".join(errors) if errors else stderr)[-limit:]


class KernelLibrary:
    """One shared library of CPU kernels, built and registered once per process, on first use.

    Args:
      label: how messages name it ("jaxkv.native").
      stem: the library file's name before its digest.
      sources: the .cc files compiled together (they include HEADER_DIR's headers).
      targets: FFI target name → the handler symbol the sources export.
      required_flags: the CPU flags (as /proc/cpuinfo spells them) every target needs.
      fallback: None, or (flags, targets): on an x86-64 CPU with these flags but without
        ``required_flags``, only these targets are built and registered (in a reduced form).
    """

    def __init__(self, label: str, stem: str, sources, targets: dict[str, str],
                 required_flags=AVX512_FLAGS, fallback: tuple[tuple[str, ...], tuple[str, ...]] | None = None):
        self.label, self.stem = label, stem
        self.sources = tuple(sorted(sources))
        self.targets, self.required_flags, self.fallback = dict(targets), tuple(required_flags), fallback
        self._decided: tuple[frozenset[str], str | None] | None = None

    def _compile_command(self, output: pathlib.Path) -> list[str]:
        return [cxx_compiler(), "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
                f"-I{jax.ffi.include_dir()}", f"-I{HEADER_DIR}", *map(str, self.sources), "-lmvec", "-o", str(output)]

    def _library_path(self) -> pathlib.Path:
        cache = pathlib.Path(os.environ.get("JAXKV_NATIVE_CACHE", pathlib.Path.home() / ".cache" / "jaxkv" / "native"))
        digest = hashlib.sha256()
        headers = sorted(HEADER_DIR.glob("*.h"))
        for part in (*(f.read_bytes() for f in self.sources + tuple(headers)),
                     " ".join(self._compile_command(pathlib.Path("x"))).encode(), cpu_flags().encode(),
                     jax.__version__.encode()):
            digest.update(part)
        path = cache / f"{self.stem}-{digest.hexdigest()[:16]}.so"
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, moved in whole
                built = pathlib.Path(tmp) / path.name
                result = subprocess.run(self._compile_command(built), capture_output=True, text=True)
                if result.returncode != 0:
                    raise NativeUnavailable(f"compiling {', '.join(s.name for s in self.sources)} failed:\n"
                                            f"{_compiler_errors(result.stderr)}")
                os.replace(built, path)
        return path

    def _missing_flags_reason(self) -> str | None:
        """Why some kernels are not built on this CPU (None on one with the required flags)."""
        flags = cpu_flags().split()
        missing = [f for f in self.required_flags if f not in flags]
        if _is_x86() and not missing:
            return None
        lacks = f"without {', '.join(missing)}" if missing else "not x86-64"
        return (f"the CPU kernels need an x86-64 CPU with {', '.join(self.required_flags)}; "
                f"this one is {platform.machine()}, {lacks}")

    def _register(self) -> frozenset[str]:
        """Builds (or finds) the library for this CPU and registers its kernels: all of them, or
        the fallback's. Raises NativeUnavailable where none can be had."""
        reason = self._missing_flags_reason()
        reduced = (reason is not None and self.fallback is not None and _is_x86()
                   and all(f in cpu_flags().split() for f in self.fallback[0]))
        if reason is not None and not reduced:
            raise NativeUnavailable(reason)
        targets = {t: self.targets[t] for t in self.fallback[1]} if reduced else self.targets
        library = ctypes.cdll.LoadLibrary(str(self._library_path()))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        return frozenset(targets)

    def _registration(self) -> tuple[frozenset[str], str | None]:
        """(the kernels registered, why the others are not): decided once per process, so a failed
        build is not retried (seconds of compiling) on every call."""
        if self._decided is None:
            try:
                registered = self._register()
                self._decided = registered, (self._missing_flags_reason() if registered != set(self.targets) else None)
            except NativeUnavailable as error:
                self._decided = frozenset(), str(error)
        return self._decided

    def reset(self) -> None:
        """Decide again on the next call (after the CPU flags or the compiler changed: tests)."""
        self._decided = None

    def unavailable_reason(self, *targets: str) -> str | None:
        """None once the kernels ``targets`` (FFI target names; default: every kernel) are
        registered, building them if needed; else why not: the CPU flags missing or the
        compiler's error."""
        unknown = set(targets) - set(self.targets)
        if unknown:
            raise ValueError(f"unknown {self.label} kernels {sorted(unknown)}; they are {sorted(self.targets)}")
        registered, reason = self._registration()
        return None if registered.issuperset(targets or self.targets) else reason

    def available(self, *targets: str) -> bool:
        """Whether the kernels ``targets`` (default: every kernel) are built and registered."""
        return self.unavailable_reason(*targets) is None

    def load(self, target: str) -> None:
        """Make sure ``target`` is registered; NativeUnavailable saying why it cannot be."""
        reason = self.unavailable_reason(target)
        if reason is not None:
            raise NativeUnavailable(reason)
