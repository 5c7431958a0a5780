"""An eval run in shards and merged is the eval of all its rows; exact groups; the sender alone skipped."""

from __future__ import annotations

import copy

import pytest
import torch

from droidmesh.shared.model.adapter import ModelAdapter, random_model
from droidmesh.shared.tasks.evaluation import FIGURES, evaluate_pair, merge
from droidmesh.shared.tasks.spec import TASKS
from droidmesh.shared.tasks.suite import SuiteShape, make_rows
from droidmesh.shared.zoo.tokenizer import WordIds, hf_tokenizer

SHAPE = SuiteShape(facts=(3, 4), docs=(1, 2), filler=(10, 20))
L = 4
SPEC = TASKS["multihop_qa"]


@pytest.fixture(scope="module")
def pair() -> tuple[ModelAdapter, ModelAdapter]:
    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": L, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": WordIds().vocab_size, "max_position_embeddings": 1024}
    recv = ModelAdapter(model=random_model("llama", seed=0, **cfg).model, tokenizer=hf_tokenizer(), name="receiver")
    send = ModelAdapter(model=copy.deepcopy(recv.model), tokenizer=recv.tokenizer, name="sender")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in send.model.model.layers[1].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return send, recv


def _eval(pair, rows, index=None, of=None):
    ev = evaluate_pair(*pair, rows, SPEC, groups=[(1, 3)], layer_stride=0, sender_alone=False, progress=False,
                       keep_rows=True, row_index=index)
    ev.update(sender="s", receiver="r", split="test", data="zoo", dtype=None)
    ev["per_row"]["of"] = of if of is not None else len(rows)
    return ev


def test_shards_merged_are_the_eval_of_all_rows(pair) -> None:
    """Three interleaved shards, merged in any order, give the unsharded eval: the same means,
    intervals and verdicts (rows back in their order before resampling), the same per-row figures."""
    rows = make_rows("multihop_qa", "test", 7, SHAPE)
    whole = _eval(pair, rows)
    shards = [_eval(pair, rows[k::3], list(range(7))[k::3], of=7) for k in range(3)]
    merged = merge([shards[2], shards[0], shards[1]])
    assert merged["rows"] == 7 and merged["per_row"]["index"] == list(range(7))
    for path in ("receiver_full_prefill", "receiver_full_reuse"):
        for f in FIGURES:
            assert merged[path][f] == pytest.approx(whole[path][f], abs=1e-6)
    assert merged["receiver_full_reuse"].get("vs_full_prefill") == whole["receiver_full_reuse"].get("vs_full_prefill")
    assert [(g["start"], g["end"]) for g in merged["groups"]] == [(1, 3)]
    assert merged["groups"][0]["quality"] == pytest.approx(whole["groups"][0]["quality"])
    assert merged["per_row"]["documents"] == whole["per_row"]["documents"]


def test_exact_groups_and_no_sender_alone(pair) -> None:
    ev = _eval(pair, make_rows("multihop_qa", "test", 2, SHAPE))
    assert ev["sender_alone"] is None and ev["summary"]["full_reuse_above_sender"] is None
    assert set(ev["per_row"]["paths"]) == {"receiver_full_prefill", "receiver_full_reuse", "group/1/3"}
    assert ev["per_layer_reuse"] == [] and len(ev["per_row"]["paths"]["group/1/3"]["quality"]) == 2


def test_merge_refuses_what_is_not_shards_of_one_eval(pair) -> None:
    rows = make_rows("multihop_qa", "test", 4, SHAPE)
    a, b = _eval(pair, rows[:2], [0, 1], of=4), _eval(pair, rows[2:], [2, 3], of=4)
    with pytest.raises(ValueError, match="more than one shard"):
        merge([a, a])
    with pytest.raises(ValueError, match="differ in .*receiver"):
        merge([a, {**b, "receiver": "other"}])
    with pytest.raises(ValueError, match="per-row"):
        merge([a, {k: v for k, v in b.items() if k != "per_row"}])
    assert merge([a, b])["rows"] == 4 and "incomplete" not in merge([a, b])


def test_shards_that_miss_rows_merge_only_when_asked_and_say_so(pair) -> None:
    """Two of three shards: refused, or with `incomplete_ok` merged and marked (a stopped run's
    shards are a sample chosen before any row was scored, not by outcome)."""
    rows = make_rows("multihop_qa", "test", 6, SHAPE)
    a, b = (_eval(pair, rows[k::3], list(range(6))[k::3], of=6) for k in range(2))
    with pytest.raises(ValueError, match="4 rows of 6"):
        merge([a, b])
    got = merge([a, b], incomplete_ok=True)
    assert got["incomplete"] == {"rows": 4, "of": 6} and got["rows"] == 4


def test_a_merge_with_no_figures_writes_every_row_and_prints_no_verdict(pair, tmp_path) -> None:
    """`eval-merge --no-figures` joins a stopped run's shards for a join with another run without
    showing the verdicts before the row count they are read at; the JSON is the same merge."""
    import json

    from click.testing import CliRunner

    from droidmesh.shared.tools.cli.eval import eval_merge

    rows = make_rows("multihop_qa", "test", 6, SHAPE)
    for k in range(2):
        (tmp_path / f"{k}.json").write_text(json.dumps(_eval(pair, rows[k::3], list(range(6))[k::3], of=6)))
    argv = [str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--incomplete"]
    shown = CliRunner().invoke(eval_merge, [*argv, "--json", str(tmp_path / "shown.json")])
    hidden = CliRunner().invoke(eval_merge, [*argv, "--json", str(tmp_path / "hidden.json"), "--no-figures"])
    assert shown.exit_code == 0 and hidden.exit_code == 0, hidden.output
    assert "vs full prefill" in shown.output and "receiver full reuse" in shown.output
    assert "vs full prefill" not in hidden.output and "receiver full" not in hidden.output
    assert "incomplete: 4 rows of 6" in hidden.output and "merged 4 rows" in hidden.output
    assert json.loads((tmp_path / "hidden.json").read_text()) == json.loads((tmp_path / "shown.json").read_text())


@pytest.mark.parametrize("spoil,match", [
    (lambda ev: ev["per_row"]["documents"].pop(), "must each list"),
    (lambda ev: ev["per_row"]["index"].__setitem__(0, -1), "integers >= 0"),
    (lambda ev: ev.__setitem__("total_layers", 0), "not an eval"),
    (lambda ev: ev["per_row"]["paths"].__setitem__("group/1", ev["per_row"]["paths"]["group/1/3"]), "unknown path"),
    (lambda ev: ev["per_row"]["paths"]["group/1/3"]["quality"].__setitem__(0, 6.5), "outside"),
    (lambda ev: ev["per_row"]["paths"]["group/1/3"]["kl"].__setitem__(0, "x"), "finite numbers"),
])
def test_a_malformed_shard_is_refused_before_it_is_read(pair, spoil, match) -> None:
    """Shard files are the user's: each malformed part is a ValueError naming what is wrong."""
    import copy as _copy

    rows = make_rows("multihop_qa", "test", 2, SHAPE)
    good = _eval(pair, rows, [0, 1], of=2)
    bad = _copy.deepcopy(good)
    spoil(bad)
    with pytest.raises(ValueError, match=match):
        merge([bad])


def test_the_by_source_interval_resamples_sources() -> None:
    """Rows naming their source file get a second interval that resamples whole sources: with
    one source carrying every difference, it is wider than the interval by document."""
    from droidmesh.shared.tasks.evaluation import _Acc

    ref, other = _Acc(), _Acc()
    ref.q = [1.0] * 40
    other.q = [0.0] * 4 + [1.0] * 36
    docs = [f"d{i}" for i in range(40)]
    sources = ["a.py"] * 4 + [f"m{i // 4}.py" for i in range(4, 40)]
    s = other.summary(ref, docs, sources)
    by_doc, by_source = s["vs_full_prefill"]["interval"], s["vs_full_prefill_by_source"]["interval"]
    assert by_source[0] < by_doc[0]
    assert "vs_full_prefill_by_source" not in other.summary(ref, docs, [None] * 40)


def test_shards_of_one_data_file_merge_by_its_bytes_not_its_path(pair) -> None:
    """Shards run from two directories name one file by two paths, and merge; two files that
    differ are refused whatever their paths say."""
    rows = make_rows("multihop_qa", "test", 4, SHAPE)
    a, b = _eval(pair, rows[:2], [0, 1], of=4), _eval(pair, rows[2:], [2, 3], of=4)
    a.update(data="rows.jsonl", data_sha256="1" * 64)
    assert merge([a, {**b, "data": "../x/rows.jsonl", "data_sha256": "1" * 64}])["data"] == "rows.jsonl"
    with pytest.raises(ValueError, match="differ in .*data_sha256"):
        merge([a, {**b, "data": "rows.jsonl", "data_sha256": "2" * 64}])
    older = {k: v for k, v in a.items() if k != "data_sha256"}  # written before files were hashed: by path
    with pytest.raises(ValueError, match="differ in .*data"):
        merge([older, {**b, "data": "other.jsonl"}])


def test_merged_shards_keep_their_predictions_in_row_order(pair) -> None:
    rows = make_rows("multihop_qa", "test", 4, SHAPE)
    a, b = _eval(pair, rows[0::2], [0, 2], of=4), _eval(pair, rows[1::2], [1, 3], of=4)
    a["predictions"] = [{"_id": 0}, {"_id": 2}]
    assert "predictions" not in merge([a, b])  # one shard without them: none
    b["predictions"] = [{"_id": 1}, {"_id": 3}]
    assert [p["_id"] for p in merge([b, a])["predictions"]] == [0, 1, 2, 3]


def test_a_plan_under_a_wire_is_scored_beside_itself_raw_and_merges(pair) -> None:
    """`wires` adds "<path>@<wire>" for full reuse and each group: a wire that sends the tensors as
    captured changes no row; int4 on every reused layer is scored as its own path; the coded
    paths survive shards and a merge."""
    from droidmesh.shared.profiling import layer_codecs
    from droidmesh.shared.tasks.scorer import RAW

    rows = make_rows("multihop_qa", "test", 4, SHAPE)
    wires = {"same": lambda plan: RAW, "int4": lambda plan: layer_codecs.named_wire("int4", plan, L, head_dim=8)}
    ev = evaluate_pair(*pair, rows, SPEC, groups=[(1, 3)], layer_stride=0, sender_alone=False, progress=False,
                       keep_rows=True, wires=wires)
    coded = {(c["path"], c["wire"]): c for c in ev["coded"]}
    assert set(coded) == {(p, w) for p in ("receiver_full_reuse", "group/1/3") for w in ("same", "int4")}
    for path in ("receiver_full_reuse", "group/1/3"):
        same = coded[(path, "same")]
        assert same["rows_changed"] == 0 and same["vs_raw"]["relative"] in (0.0, None)
        assert ev["per_row"]["paths"][f"{path}@same"]["kl"] == pytest.approx(ev["per_row"]["paths"][path]["kl"], abs=1e-6)
    assert [(g["start"], g["end"]) for g in ev["groups"]] == [(1, 3)]  # coded paths are not groups of their own
    int4_kl = ev["per_row"]["paths"]["group/1/3@int4"]["kl"]
    assert int4_kl != ev["per_row"]["paths"]["group/1/3"]["kl"]  # the codec reached the tensors
    for k in range(2):
        ev_k = evaluate_pair(*pair, rows[k::2], SPEC, groups=[(1, 3)], layer_stride=0, sender_alone=False,
                             progress=False, keep_rows=True, row_index=list(range(4))[k::2], wires=wires)
        ev_k.update(sender="s", receiver="r", split="test", data="zoo", dtype=None)
        ev_k["per_row"]["of"] = 4
        if k == 0:
            first = ev_k
    merged = merge([first, ev_k])
    assert {(c["path"], c["wire"]) for c in merged["coded"]} == set(coded)
    assert merged["per_row"]["paths"]["group/1/3@int4"]["kl"] == pytest.approx(int4_kl, abs=1e-6)
    with pytest.raises(ValueError, match="a wire's name"):
        evaluate_pair(*pair, rows[:1], SPEC, groups=[(1, 3)], layer_stride=0, progress=False, wires={"Int 4": wires["int4"]})


def test_named_wires_are_the_cli_choices_and_refuse_what_they_cannot_carry() -> None:
    import click

    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.profiling import layer_codecs
    from droidmesh.shared.tools.cli.eval import eval_cmd

    (choice,) = [p.type for p in eval_cmd.params if p.name == "wire_names"]
    assert isinstance(choice, click.Choice) and tuple(choice.choices) == layer_codecs.WIRES
    plan = ReusePlan.recompute(1, 3)
    assert layer_codecs.named_wire("int4-g64-e-int8", plan, L, head_dim=64).codec == "layered"
    with pytest.raises(ValueError, match="head dim"):
        layer_codecs.named_wire("int4-g64-e-int8", plan, L, head_dim=80)
    with pytest.raises(ValueError, match="unknown wire"):
        layer_codecs.named_wire("int2", plan, L, head_dim=64)


class _InThread:
    """`ProcessPoolExecutor` run in this process (the initializer once, each part in turn)."""

    def __init__(self, workers, mp_context=None, initializer=None, initargs=()):
        initializer(*initargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        import concurrent.futures

        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # as a pool reports a part's failure: on its future
            future.set_exception(e)
        return future


def test_an_eval_in_parts_keeps_finished_parts_refuses_another_evals_and_merges(pair, tmp_path, monkeypatch) -> None:
    """`eval --jobs`: the parts merged are the one-process eval; a stopped run's finished parts are
    not scored again; a folder of another eval's parts is refused."""
    from droidmesh.shared.errors import ConfigError
    from droidmesh.shared.tools.apps import eval_parts

    rows = make_rows("multihop_qa", "test", 5, SHAPE)
    options = {"groups": [(1, 3)], "layer_stride": 0, "sender_alone": False}
    scored: list[list[int]] = []

    def load(job):
        eval_parts._WORKER.update(job=job, sender=pair[0], receiver=pair[1], wires={})

    real_score = eval_parts._score
    monkeypatch.setattr(eval_parts.concurrent.futures, "ProcessPoolExecutor", _InThread)
    monkeypatch.setattr(eval_parts, "_load", load)
    monkeypatch.setattr(eval_parts, "_score", lambda rows_, index, total, path: (scored.append(index),
                                                                                 real_score(rows_, index, total, path)))
    monkeypatch.setattr(eval_parts, "PART_ROWS", 2)  # 3 parts of 5 rows
    job = eval_parts.Job("s", "r", SPEC, "cpu", None, (), options, {"sender": "s", "receiver": "r"})
    whole = _eval(pair, rows)
    parts = tmp_path / "parts"
    fingerprint = {"rows": 5, "options": options}
    first = eval_parts.run(job, rows, 2, parts, fingerprint)
    assert sorted(scored) == [[0, 3], [1, 4], [2]] and not parts.exists()
    for path in ("receiver_full_prefill", "receiver_full_reuse"):
        assert first[path]["quality"] == pytest.approx(whole[path]["quality"], abs=1e-6)
    assert first["per_row"]["index"] == list(range(5)) and first["rows"] == 5

    scored.clear()  # a stopped run: one part finished, then the same command again
    parts.mkdir()
    (parts / "run.json").write_text('{"rows": 5, "options": {"groups": [[1, 3]], "layer_stride": 0, '
                                    '"sender_alone": false}, "parts": 3}')
    real_score(rows[1::3], [1, 4], 5, parts / "part-1-of-3.json")
    again = eval_parts.run(job, rows, 2, parts, fingerprint)
    assert sorted(scored) == [[0, 3], [2]] and again["receiver_full_reuse"] == first["receiver_full_reuse"]

    parts.mkdir()
    (parts / "run.json").write_text('{"rows": 6}')
    with pytest.raises(ConfigError, match="another eval"):
        eval_parts.run(job, rows, 2, parts, fingerprint)
    (parts / "run.json").unlink()
    real_score(rows[1::3], [1, 4], 5, parts / "part-1-of-3.json")
    with pytest.raises(ConfigError, match="another eval"):  # parts, and nothing to say whose
        eval_parts.run(job, rows, 2, parts, fingerprint)


def test_a_worker_that_dies_leaves_the_finished_parts_and_one_line(pair, tmp_path, monkeypatch) -> None:
    import concurrent.futures.process

    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.tools.apps import eval_parts

    real_score = eval_parts._score

    def score(rows_, index, total, path):
        if index[0] == 1:
            raise concurrent.futures.process.BrokenProcessPool("killed")
        real_score(rows_, index, total, path)

    monkeypatch.setattr(eval_parts.concurrent.futures, "ProcessPoolExecutor", _InThread)
    monkeypatch.setattr(eval_parts, "_load", lambda job: eval_parts._WORKER.update(job=job, sender=pair[0],
                                                                                   receiver=pair[1], wires={}))
    monkeypatch.setattr(eval_parts, "_score", score)
    monkeypatch.setattr(eval_parts, "PART_ROWS", 2)
    job = eval_parts.Job("s", "r", SPEC, "cpu", None, (), {"groups": [(1, 3)], "layer_stride": 0}, {})
    with pytest.raises(DroidMeshError, match="run the same command again"):
        eval_parts.run(job, make_rows("multihop_qa", "test", 5, SHAPE), 2, tmp_path / "p", {"rows": 5})
    assert sorted(p.name for p in (tmp_path / "p").glob("part-*.json")) == ["part-0-of-3.json", "part-2-of-3.json"]
