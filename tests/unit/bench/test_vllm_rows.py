"""`bench vllm-rows`' arithmetic without an engine: an answer ends at its first EOS as the
engine's own decoding would end it, and the verdicts are the rows' (agreement with a Wilson
interval, quality with a paired interval and the 5 % rule)."""

from __future__ import annotations

from droidmesh.shared.tools.bench.vllm_rows import _answer, summarize


def test_an_answer_ends_at_its_first_eos_kept():
    assert _answer([5, 6, 2, 7, 2], eos=2) == [5, 6, 2]
    assert _answer([5, 6], eos=2) == [5, 6] and _answer([5, 2], eos=None) == [5, 2]


def test_the_summary_counts_paths_and_decides_with_intervals():
    same = [{"same_path": "full_reuse", "first_token_equal": i != 0, "greedy_agreement": 1.0} for i in range(10)]
    pair = [{"pair_path": "partial", "pair_first_token_equal": True, "quality_alone": q, "quality_plan": q,
             "document": f"d{i // 2}"} for i, q in enumerate([0.0, 1.0, 0.5, 1.0] * 5)]
    s = summarize(same, pair, {"full_prefill": [1.0] * 20, "plan": [0.5] * 20})
    assert s["rows"] == {"same_model": 10, "pair": 20} and s["pair"]["documents"] == 10
    assert s["same_model"]["paths"] == {"full_reuse": 10} and s["same_model"]["first_token_equal"] == 0.9
    lo, hi = s["same_model"]["first_token_interval"]
    assert lo < 0.9 < hi < 1.0
    assert s["pair"]["vllm"]["verdict"] == "within" and s["pair"]["vllm"]["relative"] == 0.0
    assert s["pair"]["droidmesh_engine"]["verdict"] == "below"  # half of full prefill's on every row


def test_vllm_against_itself_batched_is_the_yardstick_beside_full_reuse(monkeypatch):
    """`ask_batched` asks each row's full prefill again, several in flight, and compares with the
    answer asked alone; the summary reports that agreement with its own interval."""
    import threading

    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tools.bench.vllm_rows import ask_batched

    class Engine:
        """Answers [7, 8, 9]; the row whose prompt has 3 tokens answers [7, 1, 1] when batched."""

        def __init__(self):
            self.modes, self.lock = [], threading.Lock()

        def ask(self, rid, prompt, *, max_tokens, mode="auto", lora=None, timeout_s=300.0):
            with self.lock:
                self.modes.append(mode)
            return {"tokens": [7, 1, 1] if len(prompt) == 3 else [7, 8, 9], "request_id": rid}

        def events(self, event, request_id):
            return []

    class Tok:
        eos_token_id = None

    rows = [{"context": "c" * n} for n in (1, 2, 3, 4)]
    same = [{"same_path": "full_reuse", "first_token_equal": True, "greedy_agreement": 1.0, "answer_alone": [7, 8, 9]}
            for _ in rows]
    encode = {"c" * n: ([0] * (n - 1), [0], [0]) for n in (1, 2, 3, 4)}
    monkeypatch.setattr("droidmesh.shared.tools.bench.vllm_rows.encode_row", lambda tok, row, spec: encode[row["context"]])
    engine = Engine()
    ask_batched(engine, Tok(), rows, task_spec("doc_qa"), same, batch=2)
    assert engine.modes == ["full_prefill"] * 4
    assert [r["batched_greedy_agreement"] for r in same] == [1.0, 1.0, 1 / 3, 1.0]
    assert all(r["batched_first_token_equal"] for r in same)
    pair = [{"pair_path": "partial", "pair_first_token_equal": True, "quality_alone": 1.0, "quality_plan": 1.0,
             "document": "d"}]
    own = summarize(same, pair, None)["same_model"]["vllm_across_batch_sizes"]
    assert own["rows"] == 4 and own["first_token_equal"] == 1.0 and abs(own["greedy_agreement"] - (3 + 1 / 3) / 4) < 1e-9


def test_a_pair_only_summary_has_no_same_model_part_and_resamples_sources_too():
    """`--pair-only`: no same-model rows, no division by them; rows naming their source file get a
    second verdict that resamples whole sources (here one source holds every loss: wider)."""
    pair = [{"pair_path": "partial", "pair_first_token_equal": True, "quality_alone": 1.0,
             "quality_plan": 0.0 if i < 4 else 1.0, "document": f"d{i}",
             "source": "email/utils.py" if i < 4 else f"m{i // 4}.py"} for i in range(40)]
    s = summarize([], pair, None)
    assert "same_model" not in s and s["rows"] == {"same_model": 0, "pair": 40} and s["pair"]["sources"] == 10
    assert s["pair"]["vllm_by_source"]["relative_interval"][0] < s["pair"]["vllm"]["relative_interval"][0]
    assert "vllm_by_source" not in summarize([], [{**r, "source": None} for r in pair], None)["pair"]


def _partial(rows, n, *, split="heldout", same=False):
    from droidmesh.shared.tools.bench.vllm_rows import PLAN, TASK, document

    pair = [{"row": r["_id"], "document": document(r), "quality_alone": 1.0, "quality_plan": 0.5,
             "pair_first_token_equal": True, "pair_path": "partial"} for r in rows[:n]]
    asked = [{"row": r["_id"], "document": document(r), "first_token_equal": True, "greedy_agreement": 1.0,
              "same_path": "full_reuse"} for r in rows[:n]]
    return {"suite": "vllm-rows", "task": TASK, "split": split, "plan": PLAN.label(), "dtype": "float32",
            "pair_per_row": pair, "same_model_per_row": asked if same else []}


def test_a_stopped_run_resumes_at_its_first_row_not_asked_and_only_on_the_same_rows():
    """Rows are prefix-stable, so a partial run of the same task, split, plan and dtype continues
    where it stopped; anything else (another split, dtype, a row out of place, pair-only against
    not) is refused with one line before a row is asked."""
    import pytest

    from droidmesh.shared.errors import ConfigError
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tools.bench.vllm_rows import TASK, resumed

    rows = make_rows(TASK, "heldout", 6, SuiteShape())
    assert make_rows(TASK, "heldout", 4, SuiteShape()) == rows[:4]  # what resuming a longer run rests on
    got = resumed(_partial(rows, 4) | {"rows_requested": 6}, rows, "heldout", "float32", same=False)
    assert [r["row"] for r in got["pair"]] == [r["_id"] for r in rows[:4]] and got["same"] == []
    assert len(resumed(_partial(rows, 3, same=True), rows, "heldout", "float32", same=True)["same"]) == 3
    refusals = {
        "split": (_partial(rows, 4, split="test"), "float32", False),
        "dtype": (_partial(rows, 4), "bfloat16", False),
        "--rows 1200": (_partial(rows, 4) | {"rows_requested": 1200}, "float32", False),  # a count changed later
        "row 3 is not": (_partial(rows, 4) | {"pair_per_row": [*_partial(rows, 2)["pair_per_row"], 1]}, "float32", False),
        "row 2 lacks its figures": (_partial(rows, 4) | {"pair_per_row": [_partial(rows, 4)["pair_per_row"][0]] + [
            {k: v for k, v in r.items() if k != "quality_plan"} for r in _partial(rows, 4)["pair_per_row"][1:]]},
            "float32", False),
        "with --pair-only": (_partial(rows, 4), "float32", True),
        "not this run's row 2": ({**_partial(rows, 4), "pair_per_row": [_partial(rows, 4)["pair_per_row"][i]
                                                                          for i in (0, 2, 1, 3)]}, "float32", False),
        "at most": (_partial(rows, 6) | {"pair_per_row": _partial(rows, 6)["pair_per_row"] * 2}, "float32", False),
    }
    for words, (done, dtype, same) in refusals.items():
        with pytest.raises(ConfigError, match="cannot resume") as e:
            resumed(done, rows, "heldout", dtype, same=same)
        assert words in str(e.value), (words, str(e.value))


def test_resume_and_beside_refuse_a_file_that_is_not_theirs_before_anything_starts(tmp_path):
    from click.testing import CliRunner

    from droidmesh.shared.tools.cli.main import main

    other, broken = tmp_path / "other.json", tmp_path / "broken.json"
    other.write_text('{"suite": "peer", "rows": []}')
    broken.write_text('{"suite": ')
    python = tmp_path / "python"
    python.write_text("")  # never run: the file is refused first
    for path, words in ((other, "is not a `bench vllm-rows` JSON"), (broken, "cannot read")):
        out = CliRunner().invoke(main, ["bench", "vllm-rows", "--vllm-python", str(python), "--resume", str(path)])
        assert out.exit_code == 2 and words in out.output, out.output
    out = CliRunner().invoke(main, ["bench", "vllm-rows", "--vllm-python", str(python), "--beside", str(other)])
    assert out.exit_code == 2 and "not an eval" in out.output, out.output  # an eval's figures, checked first


def test_a_resumed_run_asks_only_the_rows_not_asked_and_keeps_the_rest(monkeypatch, tmp_path):
    """`run` with a partial of 4 rows asks rows 5-7 (in chunks from there) and returns all 7 in order."""
    from droidmesh.shared.model import adapter
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tools.bench import vllm_rows
    from droidmesh.shared.zoo.tokenizer import hf_tokenizer

    rows = make_rows(vllm_rows.TASK, "heldout", 7, SuiteShape())
    asked: list[list[str]] = []

    def ask_chunk(python, tier, base, docqa, part, *rest):
        asked.append([r["_id"] for r in part])
        return {"pair": _partial(part, len(part))["pair_per_row"]}

    monkeypatch.setattr(vllm_rows, "_ask_chunk", ask_chunk)
    monkeypatch.setattr(vllm_rows, "merged", lambda path, out: path)
    monkeypatch.setattr(adapter, "load_model", lambda *a, **k: type("M", (), {"tokenizer": hf_tokenizer(), "num_layers": 30})())
    saved = []
    out = vllm_rows.run("python", tmp_path, 7, tmp_path, lambda line: None, engine_too=False, chunk=2,
                        split="heldout", same=False, done=_partial(rows, 4),
                        on_chunk=lambda partial: saved.append(partial))  # as the CLI writes it
    assert asked == [[r["_id"] for r in rows[4:6]], [rows[6]["_id"]]]
    assert [r["row"] for r in out["pair_per_row"]] == [r["_id"] for r in rows] and out["rows_requested"] == 7
    assert [len(p["pair_per_row"]) for p in saved] == [6, 7] and out["summary"]["rows"]["pair"] == 7
    assert not any("summary" in p for p in saved)  # a partial run's file holds rows, never an interim verdict


def test_a_pair_rows_progress_line_names_its_path_and_never_a_score(monkeypatch):
    """The verdict is read once, on every row: a progress line that printed each row's score would
    be a running tally to read it from."""
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tools.bench import vllm_rows

    class Engine:
        def ask(self, rid, prompt, *, max_tokens, mode="auto", lora=None, timeout_s=300.0):
            return {"tokens": [7, 8], "request_id": rid}

        def events(self, event, request_id):
            return [{"path": "partial"}] if event == "request" else []

    monkeypatch.setattr(vllm_rows, "encode_row", lambda tok, row, spec: ([0, 0], [0], [0]))
    monkeypatch.setattr(vllm_rows, "decode_answer", lambda tok, answer, spec: "the answer")
    lines: list[str] = []
    got = vllm_rows.ask_pair(Engine(), type("Tok", (), {"eos_token_id": None})(),
                             [{"context": "c", "answers": ["the answer"]}], task_spec("doc_qa"), say=lines.append)
    assert got[0]["quality_alone"] == 1.0 and len(lines) == 1 and lines[0].endswith("partial")
    assert "1.00" not in lines[0] and "f1" not in lines[0].lower() and "->" not in lines[0]


def test_a_bench_json_rewritten_and_killed_while_writing_keeps_its_last_whole_version(tmp_path, monkeypatch):
    """`report.write_json` writes beside the file and renames: a write that dies midway leaves the
    previous JSON whole (what `--resume` reads back), and no partial file under the JSON's name."""
    import json
    import os

    import pytest

    from droidmesh.shared import report

    path = tmp_path / "out.json"
    report.write_json(path, {"rows": 1})

    def dies(part, target):
        raise KeyboardInterrupt  # killed between writing and renaming

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(KeyboardInterrupt):
        report.write_json(path, {"rows": 2})
    assert json.loads(path.read_text()) == {"rows": 1}


def _eval_of(rows, index, full, plan, **meta):
    """A `droidmesh eval --per-row` of base -> docqa over `rows[i]` for i in `index`."""
    from droidmesh.shared.tools.bench.vllm_rows import document

    figures = lambda q: {"quality": q, "answer_nll": [1.0] * len(q), "kl": [0.0] * len(q),  # noqa: E731
                         "top1_agreement": [1.0] * len(q), "greedy_agreement": [1.0] * len(q)}
    return {"task": "doc_qa", "split": "heldout", "sender": "real/base", "receiver": "real/docqa", "dtype": None,
            "total_layers": 30, **meta,
            "per_row": {"index": index, "ids": [rows[i]["_id"] for i in index],
                        "documents": [document(rows[i]) for i in index], "sources": [None] * len(index),
                        "paths": {"receiver_full_prefill": figures(full), "receiver_full_reuse": figures(full),
                                  "group/6/9": figures(plan)}}}


def test_the_engine_beside_vllm_is_joined_by_row_on_the_rows_both_scored():
    """An eval of every other row: the join holds those rows only, each engine's verdict is over
    them, and rows whose scores agree are counted; an eval of another pair, split or plan is refused."""
    import pytest

    from droidmesh.shared.errors import ConfigError
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tools.bench.vllm_rows import TASK, engine_beside

    rows = make_rows(TASK, "heldout", 6, SuiteShape())
    pair = _partial(rows, 6)["pair_per_row"]  # vLLM: full prefill 1.0, the plan 0.5 on every row
    ev = _eval_of(rows, [0, 2, 4], full=[1.0, 1.0, 1.0], plan=[0.5, 1.0, 0.5])
    b = engine_beside(pair, ev, "heldout", "float32")
    assert b["rows"] == 3 and b["same_score_full_prefill"] == 3 and b["same_score_plan"] == 2
    assert b["vllm"]["plan"] == 0.5 and b["droidmesh_engine"]["plan"] == pytest.approx(2 / 3, abs=1e-4)
    refusals = {"split": _eval_of(rows, [0], [1.0], [1.0], split="test"),
                "receiver": _eval_of(rows, [0], [1.0], [1.0], receiver="real/summ"),
                "dtype": _eval_of(rows, [0], [1.0], [1.0], dtype="bfloat16")}
    for words, bad in refusals.items():
        with pytest.raises(ConfigError, match=f"differs in .*{words}"):
            engine_beside(pair, bad, "heldout", "float32")
    other_plan = _eval_of(rows, [0], [1.0], [1.0])
    other_plan["per_row"]["paths"]["group/14/24"] = other_plan["per_row"]["paths"].pop("group/6/9")
    with pytest.raises(ConfigError, match="its paths"):
        engine_beside(pair, other_plan, "heldout", "float32")
    with pytest.raises(ConfigError, match="none of this run's rows"):
        engine_beside(pair[:1], _eval_of(rows, [3], [1.0], [1.0]), "heldout", "float32")
    with pytest.raises(ConfigError, match="finite"):
        engine_beside(pair, _eval_of(rows, [0], [float("nan")], [1.0]), "heldout", "float32")


def test_another_plan_is_a_run_of_its_own_joined_to_the_evals_path_of_that_group(monkeypatch, tmp_path):
    """`--plan 14:24`: a partial run of [6, 9) is not continued under it, the engine beside is the
    eval's `group/14/24`, and a group past the model's layers is refused before a mesh starts."""
    import pytest

    from droidmesh.shared.errors import ConfigError
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model import adapter
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows
    from droidmesh.shared.tools.bench import vllm_rows
    from droidmesh.shared.zoo.tokenizer import hf_tokenizer

    upper = ReusePlan.recompute(14, 24)
    rows = make_rows(vllm_rows.TASK, "heldout", 6, SuiteShape())
    with pytest.raises(ConfigError, match="run with --plan 6:9; resume it with --plan 6:9"):
        vllm_rows.resumed(_partial(rows, 4), rows, "heldout", "float32", same=False, plan=upper)
    ev = _eval_of(rows, [0, 1], [1.0, 1.0], [0.5, 1.0])
    ev["per_row"]["paths"]["group/14/24"] = ev["per_row"]["paths"].pop("group/6/9")
    assert vllm_rows.check_beside(ev, "heldout", "float32", upper) == "group/14/24"
    b = vllm_rows.engine_beside(_partial(rows, 2)["pair_per_row"], ev, "heldout", "float32", upper)
    assert b["droidmesh_engine"]["plan"] == 0.75 and b["same_score_plan"] == 1
    with pytest.raises(ConfigError, match="its paths"):
        vllm_rows.check_beside(ev, "heldout", "float32")  # the default plan's group is not in it

    monkeypatch.setattr(vllm_rows, "merged", lambda path, out: path)
    monkeypatch.setattr(adapter, "load_model", lambda *a, **k: type("M", (), {"tokenizer": hf_tokenizer(), "num_layers": 30})())
    monkeypatch.setattr(vllm_rows, "_ask_chunk", lambda *a: pytest.fail("a mesh started for a plan out of range"))
    with pytest.raises(ConfigError, match="out of range: real/base has 30 layers"):
        vllm_rows.run("python", tmp_path, 6, tmp_path, lambda line: None, engine_too=False, split="heldout",
                      same=False, plan=ReusePlan.recompute(28, 31))

    chunks, saved = [], []
    monkeypatch.setattr(vllm_rows, "_ask_chunk", lambda python, tier, base, docqa, part, *rest: (
        chunks.append(rest[-1]), {"pair": _partial(part, len(part))["pair_per_row"]})[1])
    out = vllm_rows.run("python", tmp_path, 6, tmp_path, lambda line: None, engine_too=False, chunk=3, split="heldout",
                        same=False, plan=upper, on_chunk=saved.append)
    assert chunks == [upper, upper] and out["plan"] == upper.label()
    assert [p["plan"] for p in saved] == [upper.label()] * 2


def test_a_chunks_mesh_publishes_the_plan_and_holds_its_group_starts_e(monkeypatch):
    """`_ask_chunk` hands the plan to the mesh (`pair_mesh` publishes it and starts the sender
    holding E at the group's start) and sizes the store for that many E layers."""
    import pytest

    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.names import ModelRef
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tools.bench import vllm_rows
    from droidmesh.shared.zoo.tokenizer import hf_tokenizer

    seen = {}

    class Stop(Exception):
        pass

    def mesh(*args, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(vllm_rows, "pair_mesh", mesh)
    monkeypatch.setattr(vllm_rows, "held_bytes_per_token", lambda path, dtype, e_layers: seen.setdefault("e", e_layers))
    ref = ModelRef("/nowhere", "base")
    with pytest.raises(Stop):
        vllm_rows._ask_chunk("python", "/tier", ref, ref, [{"context": "a context"}], hf_tokenizer(), task_spec("doc_qa"),
                             "float32", {}, {}, "/work", lambda line: None, False, ReusePlan.recompute(14, 24))
    assert seen["plan"] == ReusePlan.recompute(14, 24) and seen["e"] == 1


def test_bench_vllm_refuses_a_plan_past_the_models_layers_before_the_merge(monkeypatch, tmp_path):
    """`bench vllm --plan` is checked against real/base's layers before a LoRA is merged or a mesh starts."""
    import pytest

    from droidmesh.shared.errors import ConfigError
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model import adapter
    from droidmesh.shared.tools.bench import vllm_reuse
    from droidmesh.shared.zoo.tokenizer import hf_tokenizer

    monkeypatch.setattr(adapter, "load_model", lambda *a, **k: type("M", (), {"tokenizer": hf_tokenizer(), "num_layers": 30})())
    monkeypatch.setattr(vllm_reuse, "merged", lambda *a: pytest.fail("merged for a plan out of range"))
    with pytest.raises(ConfigError, match=r"recompute \[20,32\) is out of range: real/base has 30 layers"):
        vllm_reuse.run("python", tmp_path, [64], 1, 2, "float32", tmp_path, lambda line: None,
                       plan=ReusePlan.recompute(20, 32))
