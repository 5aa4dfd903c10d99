"""The sparse-method interface (jaxkv.attention.method, .registry): a method defined through it
alone runs in generate(), the registry refuses what it cannot serve, and nothing in jaxkv
discovers a method's hooks by probing for them."""
import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from helpers_tiny_models import tiny_config
from jaxkv.attention import common, registry, topk
from jaxkv.attention.method import Regions, SparseMethod
from jaxkv.cache import CacheConfig
from models.params import init_params

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a toy method: the oldest k retrieval rows

@dataclasses.dataclass(frozen=True)
class FirstKConfig:
    k: int = 4
    sink: int = 2
    local: int = 4
    window_buffer: int = 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FirstKIndex:
    n: jax.Array  # [] int32, rows indexed


class FirstK(SparseMethod):
    """Reads the first ``k`` rows of the retrieval region, whatever the query."""

    config_class = FirstKConfig

    def build(self, cfg, keys, values, n, key):
        return FirstKIndex(n=jnp.asarray(n, jnp.int32))

    def insert(self, cfg, index, keys_new, values_new, count):
        return FirstKIndex(n=index.n + count)

    def select(self, cfg, index, q):
        rows = jnp.arange(cfg.k, dtype=jnp.int32)
        live = rows < index.n
        return common.Selection(idx=jnp.where(live, rows, 0), mask=live)  # indices stay in the region

    def regions(self, cfg):  # the config names its buffer otherwise and has no dense layers
        return Regions(cfg.sink, cfg.local, cfg.window_buffer)

    def dense_layers(self, cfg):
        return ()


@pytest.fixture
def first_k():
    registry.register("first_k", FirstK())
    yield "first_k"
    registry.unregister("first_k")


CONFIG = tiny_config(vocab_size=97)
PROMPT = [int(t) for t in np.random.default_rng(4).integers(3, 97, 21)]
NEW = 12


@pytest.fixture(scope="module")
def params():
    # std 0.02 init makes every logit nearly equal; scaled up, greedy choices are clear-cut.
    return jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, init_params(CONFIG, jax.random.key(0)))


def expected_read_fraction(cfg: FirstKConfig, prompt: int, new: int) -> float:
    """Keys read / keys seen over generate()'s decode steps (one per new token after the first),
    by the four-region bookkeeping: the exact regions, plus min(k, retrieval length)."""
    s, w, u = cfg.sink, cfg.local, cfg.window_buffer
    win = min(w, max(prompt - s, 0))
    retr = prompt - min(prompt, s) - win
    read = seen = 0
    for context in range(prompt + 1, prompt + new):
        if win == w + u:  # the flush before the step's write
            win, retr = win - u, retr + u
        win += 1
        read += min(context, s) + win + min(cfg.k, retr)
        seen += context
    return read / seen


def test_a_toy_method_reading_everything_gives_dense_tokens(params, first_k):
    dense = jaxkv.generate(params, CONFIG, [PROMPT], max_new_tokens=NEW, eos_ids=())
    everything = FirstKConfig(k=len(PROMPT) + NEW)  # at least the whole retrieval region
    out = jaxkv.generate(params, CONFIG, [PROMPT], max_new_tokens=NEW, eos_ids=(), method=first_k,
                         method_config=everything, cache_config=CacheConfig(dense_threshold=0))
    assert out.tokens == dense.tokens
    assert out.keys_read_fraction == [1.0]


def test_a_toy_method_reads_what_its_selection_holds(params, first_k):
    cfg = FirstKConfig(k=3)
    out = jaxkv.generate(params, CONFIG, [PROMPT], max_new_tokens=NEW, eos_ids=(), method=first_k,
                         method_config=cfg, cache_config=CacheConfig(dense_threshold=0))
    want = expected_read_fraction(cfg, len(PROMPT), NEW)
    assert want < 0.9  # the selection leaves keys out: the count is not trivially everything
    # keys_read and keys_seen are float32 sums of integers below 2^24: exact.
    assert out.keys_read_fraction == [pytest.approx(want, rel=1e-6)]
    assert len(out.tokens[0]) == NEW


def test_registry_refuses_what_it_cannot_serve(first_k):
    with pytest.raises(ValueError, match="the name is taken"):
        registry.register(first_k, FirstK())
    with pytest.raises(ValueError, match="the name is taken"):
        registry.register("dense", FirstK())
    with pytest.raises(ValueError, match="expected a SparseMethod instance"):
        registry.register("module", topk)
    with pytest.raises(ValueError, match="TopKConfig is already the config of 'topk'"):
        registry.register("topk_again", topk.TopK())
    with pytest.raises(ValueError, match="unknown method 'nope'; choose one of: dense, first_k, hybrid"):
        registry.get("nope")
    with pytest.raises(ValueError, match="no registered sparse method takes a FirstKIndex"):
        registry.for_config(FirstKIndex(n=jnp.int32(0)))
    assert registry.for_config(FirstKConfig()) == FirstK()  # stateless: equal, one jit cache entry


def test_a_method_must_implement_the_index_hooks():
    class NoSelect(SparseMethod):
        config_class = FirstKConfig

        def build(self, cfg, keys, values, n, key):
            return ()

        def insert(self, cfg, index, keys_new, values_new, count):
            return index

    with pytest.raises(TypeError, match="select"):
        NoSelect()


# ---------------------------------------------------------------- no hook discovered by probing

def probes(source: str, *, getattr_default: bool) -> list[str]:
    """Where ``source`` probes objects for attributes: hasattr(...), sys.modules, and (when
    ``getattr_default``) getattr(..., default)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (getattr_default and node.func.id == "getattr" and len(node.args) == 3):
                found.append(f"line {node.lineno}: {node.func.id}(...)")
        elif isinstance(node, ast.Attribute) and node.attr == "modules" and getattr(node.value, "id", "") == "sys":
            found.append(f"line {node.lineno}: sys.modules")
    return found


def test_the_probe_finder_finds_probes():
    source = "import sys\nif hasattr(m, 'x'): pass\ny = getattr(m, 'y', None)\nz = sys.modules[__name__]\n"
    assert probes(source, getattr_default=True) == ["line 2: hasattr(...)", "line 3: getattr(...)",
                                                    "line 4: sys.modules"]
    assert probes("getattr(m, 'y')\n", getattr_default=True) == []


def test_nothing_in_jaxkv_discovers_method_hooks_by_probing():
    """No hasattr or sys.modules anywhere in jaxkv/; in the cache and the methods, no getattr
    with a default either (a hook or config field is declared, not looked for)."""
    strict = {ROOT / "jaxkv" / "cache.py", *(ROOT / "jaxkv" / "attention").glob("*.py")}
    found = {}
    for path in sorted((ROOT / "jaxkv").rglob("*.py")):
        hits = probes(path.read_text(), getattr_default=path in strict)
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found
