"""Benchmarks that ship with the package: ``jaxkv bench`` runs :mod:`jaxkv.bench.attention`
(the decode-step attention time per method and context length) on synthetic keys fitted to
SmolLM2's (:mod:`jaxkv.bench.synthetic_keys`)."""
