"""Host-side work of the offloaded cache, made explicit, and the bytes that cross to and from it.

The retrieval region (and MagicPIG's index) lives in ``pinned_host`` memory. Work on it
runs in explicit host computations (:func:`on_host`: ``jax.experimental.compute_on``'s
``device_host``), fed and drained by explicit ``jax.device_put`` transfers, so that no
op outside a host computation reads host memory and XLA never has to infer host work
(which its GPU host offloader warns is "likely very slow", and whose scatter into host
memory matches an open XLA crash, openxla/xla#34565).

:func:`transfers` reads a traced program (a jaxpr) and sums the bytes of those
transfers per direction, and lists the ops that would still need XLA's inference: the
accounting behind the data-movement table (benchmarks/data_movement.py) and the tests
that a flush moves O(U) rows.
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax.experimental import compute_on as _compute_on
from jax.interpreters import batching, mlir

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device

# JAX 0.10 has compute_on as a context manager and the function form as compute_on2;
# 0.11 renamed compute_on2 to compute_on and dropped the context manager.
_host_computation = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on


# Inside a host computation every array is the host's own, but JAX types the operands by
# where they live (host) and the arrays the body creates (jnp.arange, ...) as device ones,
# and refuses to combine the two. This cast re-types an operand as the body's own; it
# lowers to nothing (no copy, no transfer), and is used only inside host computations.
_local_p = jax.extend.core.Primitive("host_local")
_local_p.def_abstract_eval(lambda aval: aval.update(memory_space=DEVICE))
mlir.register_lowering(_local_p, lambda ctx, x: [x])
batching.primitive_batchers[_local_p] = lambda args, dims: (_local_p.bind(*args), dims[0])


def _local(x):
    return _local_p.bind(x) if getattr(jax.typeof(x), "memory_space", DEVICE) == HOST else x


def on_host(f, out_memory_space=HOST):
    """f as an explicit host computation: it runs on the host CPU, reading its operands in
    host memory, and its results stay in ``out_memory_space`` (every result alike).

    Callers move device operands in first (``jax.device_put(x, HOST)``) so every transfer is
    a visible ``device_put``. On the CPU backend the computation is inlined.
    """
    def body(*args):
        return f(*jax.tree.map(_local, args))

    def run(*args):
        out_shape = jax.eval_shape(body, *args)
        return _host_computation(body, compute_type="device_host",
                                 out_memory_spaces=jax.tree.map(lambda _: out_memory_space, out_shape))(*args)
    return run


def to_host(tree):
    """Every array of ``tree`` moved to host memory (explicit transfers)."""
    return jax.tree.map(lambda x: jax.device_put(x, HOST), tree)


def to_device(tree):
    """Every array of ``tree`` moved to device memory (explicit transfers)."""
    return jax.tree.map(lambda x: jax.device_put(x, DEVICE), tree)


# ----------------------------------------------------------------------------
# Accounting.


@dataclasses.dataclass(frozen=True)
class Transfers:
    """What a traced program moves between host and device memory, in bytes.

    to_device / to_host: bytes moved host → device / device → host. A ``cond``
    counts its costliest branch (one execution takes one branch), a ``scan``
    its body times its length; a transfer in a ``while`` loop raises (its count
    depends on the data).
    implicit: the ops outside a host computation that read host memory (their
    primitive names): work XLA would have to move to the host itself.
    """

    to_device: int = 0
    to_host: int = 0
    implicit: tuple[str, ...] = ()

    def __add__(self, other: "Transfers") -> "Transfers":
        return Transfers(self.to_device + other.to_device, self.to_host + other.to_host,
                         self.implicit + other.implicit)

    def times(self, n: int) -> "Transfers":
        return Transfers(self.to_device * n, self.to_host * n, self.implicit)


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


def _space(var):
    return getattr(var.aval, "memory_space", DEVICE)


def _subjaxprs(params):
    """The jaxprs among an equation's parameters (a call's body, a cond's branches, ...)."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _moves(pairs) -> Transfers:
    """Transfers of (source var, destination var) pairs that change memory space."""
    total = Transfers()
    for src, dst in pairs:
        if _space(src) == _space(dst):
            continue
        moved = _nbytes(dst.aval)
        total += Transfers(to_device=moved) if _space(dst) == DEVICE else Transfers(to_host=moved)
    return total


def _eqn_transfers(eqn) -> Transfers:
    """:class:`Transfers` of one jaxpr equation (a call, branch or loop by its bodies)."""
    name = eqn.primitive.name
    if name == "device_put":
        return _moves(zip(eqn.invars, eqn.outvars))
    if name == "compute_on":  # host-local inside; its operands and results cross if they are on the device
        ins = sum((Transfers(to_host=_nbytes(v.aval)) for v in eqn.invars if _space(v) == DEVICE), Transfers())
        outs = sum((Transfers(to_device=_nbytes(v.aval)) for v in eqn.outvars if _space(v) == DEVICE), Transfers())
        return ins + outs
    if name == "cond":
        branches = [jaxpr_transfers(b.jaxpr) for b in eqn.params["branches"]]
        costliest = max(branches, key=lambda b: b.to_device + b.to_host)
        return dataclasses.replace(costliest, implicit=sum((b.implicit for b in branches), ()))
    if name == "scan":
        return jaxpr_transfers(eqn.params["jaxpr"].jaxpr).times(eqn.params["length"])
    if name == "while":
        inner = sum((jaxpr_transfers(j) for j in _subjaxprs(eqn.params)), Transfers())
        if inner.to_device or inner.to_host:
            raise ValueError("a transfer inside a while loop: its count depends on the data")
        return inner
    inner = [jaxpr_transfers(j) for j in _subjaxprs(eqn.params)]
    if inner:
        return sum(inner, Transfers())
    if any(_space(v) == HOST for v in eqn.invars):
        return Transfers(implicit=(name,))
    return Transfers()


def jaxpr_transfers(jaxpr) -> Transfers:
    """:class:`Transfers` of a jaxpr (``jax.extend.core.Jaxpr``), its calls, branches and loops included."""
    return sum((_eqn_transfers(eqn) for eqn in jaxpr.eqns), Transfers())


def transfers(f, *args) -> Transfers:
    """:class:`Transfers` of ``f(*args)`` as traced under jit (args may be abstract: avals keep
    their memory space, e.g. the ``out_avals`` of another traced program)."""
    return jaxpr_transfers(jax.jit(f).trace(*args).jaxpr.jaxpr)
