"""jaxkv.eval.ruler_runner: batching, scoring, aggregation, JSON and the CLI, with generation faked.

The model path (prefill once, generate per method) is checked with injected
fake prefill/generate functions that record how they were called; scores are
RULER's string match from jaxkv.eval.ruler, so the expected accuracies below
follow from which fake answers contain the references.
"""
import json
import types

import pytest

from jaxkv import cli
from jaxkv.attention import registry
from jaxkv.eval import ruler, ruler_runner as rr


def example(task="niah_single", length=2048, seed=0, answers=("1234567",), max_new_tokens=128):
    return ruler.Example(task=task, length=length, prompt=f"prompt {task} {length} {seed}", answers=answers,
                         metric="all", meta=types.MappingProxyType({"seed": seed, "prompt_tokens": 10 + seed}),
                         max_new_tokens=max_new_tokens)


METHODS = (rr.MethodSpec("dense", "dense"), rr.MethodSpec("half", "topk"))


def half_right_answerer(calls):
    """dense repeats every reference; "half" is right on even seeds, reading 10% (even) or 20% (odd) of keys."""
    def answer(examples, methods):
        calls.append([e.meta["seed"] for e in examples])
        return {
            "dense": [rr.Answer(" ".join(e.answers), 1.0) for e in examples],
            "half": [rr.Answer(" ".join(e.answers) if e.meta["seed"] % 2 == 0 else "no idea",
                               0.1 if e.meta["seed"] % 2 == 0 else 0.2) for e in examples],
        }
    return answer


def suite():
    # 4 niah_single + 2 common_words at 2048, then 2 niah_single at 4096.
    return ([example(seed=s) for s in range(4)]
            + [example("common_words", seed=s, answers=("apple", "pear")) for s in range(2)]
            + [example(length=4096, seed=s) for s in range(2)])


def test_batches_group_consecutive_examples_of_one_length_up_to_batch_size():
    groups = rr.batches(suite(), batch_size=4)
    assert [[(e.length, e.meta["seed"]) for e in g] for g in groups] == [
        [(2048, 0), (2048, 1), (2048, 2), (2048, 3)], [(2048, 0), (2048, 1)], [(4096, 0), (4096, 1)]]
    with pytest.raises(ValueError, match="batch_size"):
        rr.batches(suite(), batch_size=0)


def test_evaluate_scores_every_example_with_every_method_and_summarizes():
    calls, seen = [], []
    records = rr.evaluate(suite(), METHODS, half_right_answerer(calls), batch_size=4,
                          on_batch=lambda rs: seen.append(len(rs)))
    assert calls == [[0, 1, 2, 3], [0, 1], [0, 1]]
    assert seen == [8, 12, 16]  # records so far after each batch: examples x 2 methods
    cells = {(c.task, c.length, c.method): c for c in rr.summarize(records)}
    assert cells["niah_single", 2048, "dense"].accuracy == 100.0
    assert cells["niah_single", 2048, "half"].accuracy == 50.0  # seeds 0, 2 right; 1, 3 wrong
    assert cells["niah_single", 2048, "half"].n == 4
    assert cells["niah_single", 2048, "half"].keys_read_fraction == pytest.approx(0.15)
    assert cells["common_words", 2048, "half"].accuracy == 50.0
    # average = mean of the per-task accuracies (not of examples): (50 + 50) / 2.
    assert cells["average", 2048, "half"].accuracy == 50.0
    assert cells["average", 2048, "half"].n == 6
    assert rr.relative_to_dense(list(cells.values()))["half"] == {2048: 0.5, 4096: 0.5}


def test_string_match_all_gives_partial_credit():
    # common_words is scored by the fraction of its references present.
    records = rr.score_batch([example("common_words", answers=("apple", "pear"))],
                             {"dense": [rr.Answer("Apple, banana", 1.0)]}, METHODS[:1])
    assert records[0].score == 0.5


def test_score_batch_names_the_method_with_missing_answers():
    with pytest.raises(ValueError, match="'half'.*expected 2"):
        rr.score_batch([example(), example(seed=1)],
                       {"dense": [rr.Answer("x", 1.0)] * 2, "half": [rr.Answer("x", 1.0)]}, METHODS)


def test_duplicate_method_labels_are_rejected():
    with pytest.raises(ValueError, match="unique"):
        rr.evaluate(suite(), (METHODS[0], METHODS[0]), half_right_answerer([]), batch_size=2)


def test_markdown_rows_cells_and_ratio():
    records = rr.evaluate(suite(), METHODS, half_right_answerer([]), batch_size=4)
    table = rr.markdown(rr.summarize(records), ["dense", "half"])
    assert "| niah_single | 2048 | 4 | 100.0 (100.0%) | 50.0 (15.0%) |" in table
    assert "| **average** | 4096 | 2 | 100.0 (100.0%) | 50.0 (15.0%) |" in table
    assert "| avg / dense | 2048 | | 100% | 50% |" in table


class FakeTokenizer:
    def encode(self, text):
        return [len(word) for word in text.split()]

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def test_model_answerer_prefills_once_and_decodes_each_method_from_it():
    prefills, generations = [], []
    prefilled = object()

    def fake_prefill(params, config, ids, *, capacity):
        prefills.append((ids, capacity))
        return prefilled

    def fake_generate(params, config, prompts, *, max_new_tokens, method, method_config, cache_config, prefilled):
        generations.append(dict(max_new_tokens=max_new_tokens, method=method, method_config=method_config,
                                cache_config=cache_config, prefilled=prefilled, prompts=prompts))
        tokens = [list(range(max_new_tokens))] * 2
        return types.SimpleNamespace(tokens=tokens, keys_read_fraction=None if method == "dense" else [0.05, 0.07])

    methods = rr.default_methods()[:2]  # dense and MagicPIG K10L150
    answerer = rr.model_answerer("params", "config", FakeTokenizer(), cap=40,
                                 generate_fn=fake_generate, prefill_fn=fake_prefill)
    # variable_tracking's RULER budget is 30 < cap: its answer is cut at 30 tokens.
    batch = [example(seed=1), example("variable_tracking", seed=2, answers=("ABCDE",), max_new_tokens=30)]
    answers = answerer(batch, methods)
    ids = [FakeTokenizer().encode(e.prompt) for e in batch]
    assert prefills == [(ids, 2048)]  # the examples' nominal length: one cache size for the whole length
    assert [g["method"] for g in generations] == ["dense", "magicpig"]
    assert all(g["prefilled"] is prefilled and g["prompts"] is None and g["max_new_tokens"] == 40
               for g in generations)
    assert generations[0]["method_config"] is None and generations[0]["cache_config"] is None
    assert generations[1]["method_config"] == methods[1].method_config
    assert generations[1]["cache_config"].dense_threshold == 0
    assert [len(a.text.split()) for a in answers["dense"]] == [40, 30]
    assert [a.keys_read_fraction for a in answers["dense"]] == [1.0, 1.0]
    assert [a.keys_read_fraction for a in answers["magicpig_K10L150"]] == [0.05, 0.07]
    # A nominal length shorter than prompt + answer (not what ruler makes) still gets room.
    answerer([example(length=8, seed=1)], methods[:1])
    assert prefills[-1][1] == 4 + 40


def test_default_methods_disable_dense_fallback_and_fit_ten_percent_at_8k():
    methods = {m.label: m for m in rr.default_methods()}
    assert list(methods) == ["dense", "magicpig_K10L150", "magicpig_K10L75", "pariskv", "hybrid", "topk"]
    for spec in list(methods.values())[1:]:
        assert spec.cache_config.dense_threshold == 0
    for label in ("pariskv", "hybrid", "topk"):  # the hybrid's regression tail reads no K/V row
        c = methods[label].cache_config
        # worst case: sink + full local window + full buffer + top_k exact rows
        top_k = registry.get(methods[label].method).top_k(methods[label].method_config)
        assert (c.sink + c.local + c.buffer + top_k) / 8192 <= 0.10


def test_index_bytes_per_key_match_design():
    methods = {m.label: m for m in rr.default_methods()}
    # DESIGN.md: MagicPIG keeps L 32-bit entries per key, 600 B at L=150.
    assert rr.index_bytes_per_key(methods["magicpig_K10L150"], 64) == 600
    assert rr.index_bytes_per_key(methods["magicpig_K10L75"], 64) == 300
    # ParisKV, d=64, m=8: 8 subspaces -> 8 B bucket ids + 32 B of 4-bit codes + 8 f32 weights.
    assert rr.index_bytes_per_key(methods["pariskv"], 64) == 8 + 24 + 2 + 4
    # The hybrid's regression tail keeps no per-key bytes beyond ParisKV's codes.
    assert rr.index_bytes_per_key(methods["hybrid"], 64) == rr.index_bytes_per_key(methods["pariskv"], 64)
    assert rr.index_bytes_per_key(methods["topk"], 64) == 0


def test_json_round_trip_and_cli_merge(tmp_path):
    records = rr.evaluate(suite(), METHODS, half_right_answerer([]), batch_size=4)
    short = [r for r in records if r.length == 2048]
    long = [r for r in records if r.length == 4096]
    rr.write_json(tmp_path / "a.json", short, {"command": "a"})
    rr.write_json(tmp_path / "b.json", long, {"command": "b"})
    meta, loaded = rr.load_records(tmp_path / "a.json")
    assert meta == {"command": "a"} and loaded == short
    assert cli.main(["eval", "ruler", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "merged.json").read_text())
    assert len(merged["records"]) == len(records)
    assert {(c["task"], c["length"], c["method"]): c["accuracy"] for c in merged["summary"]} == {
        (c.task, c.length, c.method): c.accuracy for c in rr.summarize(records)}
    assert "| avg / dense | 4096 | | 100% | 50% |" in (tmp_path / "merged" / "merged.md").read_text()


def test_cli_merge_refuses_an_answer_present_in_two_parts(tmp_path, capsys):
    records = rr.evaluate(suite(), METHODS, half_right_answerer([]), batch_size=4)
    rr.write_json(tmp_path / "a.json", records, {"command": "a"})
    rr.write_json(tmp_path / "b.json", records[-1:], {"command": "b"})
    assert cli.main(["eval", "ruler", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--out", str(tmp_path / "merged")]) == 1  # runtime: the content conflicts
    assert "both hold half's answer to niah_single at 4096" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_cli_merge_of_a_file_that_is_not_a_result_is_a_user_error(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert cli.main(["eval", "ruler", "--merge", str(bad), "--out", str(tmp_path)]) == 1  # runtime: not a result
    assert "has no 'records'" in capsys.readouterr().err


def test_cli_parser_accepts_quick():
    args = cli.build_parser().parse_args(["eval", "ruler", "--quick"])
    assert args.study == "ruler" and args.quick and args.out == "results/ruler"



def test_output_stem_names_the_subset_a_run_covers():
    assert rr.output_stem(True, (2048,), None, None) == "quick"
    assert rr.output_stem(False, (2048, 4096), None, None) == "ruler_2048_4096"
    assert (rr.output_stem(False, (8192,), "niah_single, niah_multikey", None)
            == "ruler_8192_niah_single-niah_multikey")
    assert rr.output_stem(False, (8192,), "common_words", "dense,hybrid") == "ruler_8192_common_words_dense-hybrid"


def test_resume_keeps_finished_examples_and_returns_the_rest(tmp_path):
    examples = suite()
    records = rr.evaluate(examples, METHODS, half_right_answerer([]), batch_size=4)
    meta = rr.settings(METHODS, 64, 512, 48)
    # A killed run: the first four examples answered by both methods, the fifth by dense only.
    first_four = {rr.example_key(e) for e in examples[:4]}
    written = [r for r in records if r.example in first_four]
    written += [r for r in records if r.example == rr.example_key(examples[4]) and r.method == "dense"]
    rr.write_json(tmp_path / "run.json", written, {"command": "x", **meta, "seconds": 12.5})
    resumed_meta = dict(meta)
    kept, rest = rr.resume(tmp_path / "run.json", resumed_meta, METHODS, examples)
    assert kept == [r for r in written if r.example in first_four]
    assert rest == list(examples[4:]) and resumed_meta["resumed_after_seconds"] == 12.5
    with pytest.raises(ValueError, match="other methods or answer cap"):
        rr.resume(tmp_path / "run.json", rr.settings(METHODS, 64, 512, 30), METHODS, examples)
