"""One `droidmesh profile` request as a library call, the files it writes and the lines it prints.

`ProfileJob` is the command's request (the pair, the task, where the files go, the rows, the
search and its budget). `run_job` profiles the pair (`profile.profile_checkpoints`), marks the
JSON with the profiled weights and the sample's warning, and writes the JSON, the maps/ files
next to it and the plots; `summary_lines` and `transfer_lines` are what the command prints after.
`run_translated` is the `--translate` path: it fits a translated pair's translator and writes it
with the JSON; `format_translated` is its table, which `droidmesh eval --translator` prints too.

Called by the CLI (`droidmesh profile`, `droidmesh eval`) on its one thread. `run_job` and
`run_translated` block for the whole profile: both models loaded, every plan scored on the rows
(minutes on a tiny pair, hours on a real one on a CPU core); the rest only formats. Publishing over
NATS stays with the caller. The heavy imports (torch, through the models and `profile.py`) wait
inside the functions, so importing this module costs the CLI's startup nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling import evidence
from droidmesh.shared.tasks.intervals import versus_text

if TYPE_CHECKING:
    from droidmesh.shared.wire import schemas

# When a profile's choice means nothing: fewer test rows than this, or a gap between full prefill
# and full reuse (test split) below the sampling noise 1/sqrt(n) -- two standard errors of the mean
# of a metric in [0, 1] at its worst-case variance (0.25). Below it the sample cannot tell full
# reuse from full prefill, so which group "restores" quality is not supported by the data.
MIN_TEST_ROWS = 20
# `droidmesh profile` fits this many minutes unless told otherwise (`--budget 0`: no limit). The
# whole profile of a 30-layer real model on a CPU core is hours (4 h 19 min for SmolLM2-135M on
# 50 + 50 QA rows); a default that starts a job of that size unasked is one nobody wants, and an
# hour is what a person leaves a profile running for before coming back to it.
DEFAULT_BUDGET_MIN = 60.0


@dataclasses.dataclass(frozen=True)
class ProfileJob:
    """A profile request, field for field the options of `droidmesh profile` (see its help)."""

    sender: ModelRef
    receiver: ModelRef
    task: str
    json_path: str
    plot_path: str | None = None
    n_train: int = 50
    n_test: int = 50
    data: str | None = None  # one JSONL file, split in two (`datasets.split_rows`)
    data_train: str | None = None
    data_test: str | None = None
    metric: str | None = None  # None: the task's
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    granularity: int = 2
    tolerance: float = 0.05
    search_kind: str = "guided"
    exhaustive: bool = False
    budget: float = DEFAULT_BUDGET_MIN  # minutes; 0: no limit
    allow_no_signal: bool = False
    robustness: bool = True
    other_tasks: tuple[str, ...] = ()  # empty: the task's default robustness sets
    transfer_search: bool = True
    max_layers: int | None = None  # the fidelity search's cap on the group's layers
    device: str = DEFAULT_DEVICE
    dtype: str | None = None

    @property
    def pair(self) -> Pair:
        return Pair(self.sender.name, self.receiver.name)

    @property
    def translators_dir(self) -> Path:
        """Where a translated pair's translator file is written: next to the JSON."""
        return Path(self.json_path).parent / "translators"


def sample_warning(result: dict, n_test_rows: int) -> str | None:
    """Why the profile's choice is not meaningful, or None when the sample supports it."""
    noise = 1 / max(1, n_test_rows) ** 0.5
    gap = result["full_prefill"]["quality_test"] - result["full_reuse"]["quality_test"]
    if n_test_rows < MIN_TEST_ROWS:
        return f"only {n_test_rows} test rows (< {MIN_TEST_ROWS}): the chosen group is not meaningful; use more rows"
    if gap < noise:
        return (f"full reuse loses {gap:.3f} on the test split, below the sampling noise 1/sqrt({n_test_rows}) = "
                f"{noise:.3f}: the sample cannot tell which layers matter; use more rows")
    return None


def chosen_test_line(result: dict) -> str:
    """The chosen plan on the test split (`evidence.test_line`)."""
    ch, interval = result["chosen"], result["chosen"].get("test_interval")
    span = [interval["rel_lo"], interval["rel_hi"]] if interval and interval["rel_lo"] is not None else None
    return evidence.test_line(ch.get("passes_test"), interval["verdict"] if interval else None, span,
                              interval["rows"] if interval else None, result["tolerance"])


def cap_warning(result: dict) -> str | None:
    """Why a plan under --max-layers was raced though the divergence says it will not hold."""
    fid = result.get("fidelity") or {}
    if not fid.get("short_of_kl_share"):
        return None
    short, settings = fid["short_of_kl_share"][0], fid["settings"]
    return (f"no group of <= {settings['max_layers']} layers removes {settings['kl_share']:.0%} of full reuse's "
            f"divergence: the closest, {short['plan']}, removes {short['share_removed']:.0%}; it was raced anyway; "
            "expect it to lose quality (more layers, or no reuse, for this pair)")


def test_rule_warning(result: dict) -> str | None:
    """Why the chosen plan must not be published as it is, or None when it is not shown to fail on
    the test split (an undecided interval is said in the summary, not refused)."""
    ch, fp, tol = result["chosen"], result["full_prefill"], result["tolerance"]
    if ch.get("passes_test", True) is not False:
        return None
    if ch.get("test_interval"):
        return f"the chosen group {chosen_test_line(result)}; `droidmesh config publish` refuses it without --force"
    return (f"the chosen group fails the {tol:.0%} rule on the test split: test {ch['quality_test']:.3f} < "
            f"{1 - tol:g} x full prefill {fp['quality_test']:.3f}; `droidmesh config publish` refuses it without --force")


def run_job(job: ProfileJob, say: Callable[[str], None]
            ) -> tuple[dict[str, Any], schemas.RecomputeConfig, dict[str, bytes]]:
    """Profile `job`'s pair and write its files: (the profile JSON, the config to publish, the
    SCD maps files by sha256). `say` gets the progress lines meant for stderr: the estimated cost,
    what the budget cut, and the warnings. Bad arguments, rows or files raise a DroidMeshError
    (rows that cannot support a choice: NoSignalError), before the models load where it can."""
    from droidmesh.shared.profiling import fidelity, profile
    from droidmesh.shared.tasks.jsonl import read_jsonl

    settings = profile.ProfileSettings(granularity=job.granularity, tolerance=job.tolerance, search=job.search_kind,
                                       exhaustive=job.exhaustive, require_signal=not job.allow_no_signal,
                                       budget_s=job.budget * 60 if job.budget else None,
                                       fidelity=fidelity.Settings(max_layers=job.max_layers))
    for path in (job.data, job.data_train, job.data_test):  # a bad file fails now, not after the models load
        if path:
            read_jsonl(path)
    maps: dict[str, bytes] = {}
    result, cfg = profile.profile_checkpoints(
        job.sender, job.receiver, job.task, settings, n_train=job.n_train, n_test=job.n_test, data=job.data,
        data_train=job.data_train, data_test=job.data_test, metric=job.metric, max_new_tokens=job.max_new_tokens,
        stop=job.stop or None, device=job.device, dtype=job.dtype,
        other_tasks=(list(job.other_tasks) or None) if job.robustness else [], transfer_search=job.transfer_search,
        maps_out=maps, say=say)
    # Which weights were profiled, so `droidmesh config publish` binds the file to exactly them.
    # A checkpoint path is recorded absolute: `config publish` may run from another directory.
    result["models"] = {role: ref.label if ref.tier else str(Path(ref.path).resolve())
                        for role, ref in (("sender", job.sender), ("receiver", job.receiver))}
    result["models"].update(sender_sha256=job.sender.sha256, receiver_sha256=job.receiver.sha256)
    result["sample_warning"] = sample_warning(result, result["rows"]["test"])
    for warning in (result["sample_warning"], cap_warning(result), test_rule_warning(result)):
        if warning:
            say(f"warning: {warning}")
    _write(job, result, maps)
    return result, cfg, maps


def _write(job: ProfileJob, result: dict[str, Any], maps: dict[str, bytes]) -> None:
    """The JSON, the maps files it names (maps/<sha256>.safetensors next to it), and the plots."""
    from droidmesh.shared.profiling.plot import frontier_png, transfer_png

    out = Path(job.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for sha, data in maps.items():  # named as the JSON's transfer configs name them (maps_file)
        (out.parent / "maps").mkdir(exist_ok=True)
        (out.parent / "maps" / f"{sha}.safetensors").write_bytes(data)
    if job.plot_path:
        plot = Path(job.plot_path)
        frontier_png(result, job.plot_path, result["evaluated"])
        if "transfer" in result:
            transfer_png(result, str(plot.with_name(plot.stem + "-transfer.png")))


def summary_lines(job: ProfileJob, result: dict[str, Any]) -> list[str]:
    """The profile in a few lines: the headline plans on both splits, the choice and whether it
    holds on test, the searches and their cost, robustness, and the transfer table."""
    from droidmesh.shared.profiling.cost import duration

    ch, fp, fr = result["chosen"], result["full_prefill"], result["full_reuse"]
    lines = [f"{job.pair.id} on {job.task} ({result['total_layers']} layers)",
             f"  full prefill  train {fp['quality_train']:.3f}  test {fp['quality_test']:.3f}",
             f"  full reuse    train {fr['quality_train']:.3f}  test {fr['quality_test']:.3f}",
             f"  chosen [{ch['start']},{ch['end']}) ({ch['recomputed_layers']} layers)  "
             f"train {ch['quality_train']:.3f}  test {ch['quality_test']:.3f}  " + chosen_test_line(result)]
    sc = result["scattered_critical"]
    if sc is not None:  # a coarse search runs no sensitivity pass
        lines.append(f"  critical layers {result['critical_layers']}  recomputed alone: train {sc['quality_train']:.3f}"
                     f"  test {sc['quality_test']:.3f}")
    sp = result["chosen_split"]
    lines.append(f"  chosen layers as {len(sp['groups'])} one-layer groups ({sp['e_transitions']} E transitions): "
                 f"train {sp['quality_train']:.3f}  test {sp['quality_test']:.3f}")
    ev, kind = result["evaluations"], result["search"]
    lines.append(f"  {kind} search: {ev[kind]} configs + {ev['sensitivity']} sensitivity"
                 + (f"; agrees with the exhaustive one ({ev['exhaustive']} configs): {result['searches_agree']}"
                    if ev["exhaustive"] else "")
                 + f"; {duration(result['cost']['elapsed_s'])} (estimated {duration(result['cost']['estimated_s'])})")
    lines += fidelity_lines(result)
    for r in result["robustness"]:
        lines.append(f"  robustness {r['task']:<22} full prefill {r['full_prefill']:.3f}  chosen {r['chosen']:.3f}  "
                     f"difference {r['difference']:+.3f}"
                     + (f" ({r['relative']:+.1%})" if r["relative"] is not None else " (receiver scores 0 here)"))
    if "transfer" in result:
        lines += transfer_lines(result["transfer"])
    return lines


def _cap(fid: dict[str, Any]) -> str:
    cap = (fid.get("settings") or {}).get("max_layers")
    return f" (groups of <= {cap} layers)" if cap is not None else ""


def fidelity_lines(result: dict[str, Any]) -> list[str]:
    """The fidelity search's race, a line per plan, and full reuse's own test interval."""
    fid, lines = result.get("fidelity"), []
    if fid:
        lines.append(f"  divergence on {fid['probe_rows']} rows: full reuse {fid['full_reuse_kl']:.4f} nats; "
                     f"short list {', '.join(fid['shortlist']) or 'empty'}{_cap(fid)}; race on up to {fid['race_rows']} rows "
                     f"({fid['race_row_scores']} row scores): " + ("decided" if fid["decided"] else "UNDECIDED"))
        for e in fid["race"]:
            span = e["relative_interval"]
            lines.append(f"    {e['plan']:<18} {e['rows']:>4} rows  {e['verdict']:<9}"
                         + (f" [{span[0]:+.1%}, {span[1]:+.1%}]" if span else "")
                         + (f"  dropped: {e['dropped']}" if e["dropped"] else ""))
    fr = (result["full_reuse"] or {}).get("test_interval")
    if fr and fr.get("rel_lo") is not None:
        lines.append(f"  full reuse on test: {fr['verdict']} [{fr['rel_lo']:+.1%}, {fr['rel_hi']:+.1%}] against full "
                     f"prefill, {fr['rows']} rows ({fr['documents']} documents)")
    return lines


def transfer_lines(t: dict[str, Any]) -> list[str]:
    """The transfer search's table: per config, bytes, quality, and where it is the fastest."""
    cal, tokens = t["calibration"], max(t["tokens"])
    lines = [f"  transfer search (maps fitted on {cal['contexts']} contexts, {cal['tokens']} tokens, "
             f"{cal['fit_s']:.1f}s; predicted TTFT at {tokens} tokens, Gbit/s "
             + " / ".join(f"{r:g}" for r in t["link_gbit_s"]) + ")"]
    for c in t["configs"]:
        ttft = " / ".join(f"{s * 1e3:.0f}" for s in c["predicted_ttft_s"][str(tokens)].values())
        fastest = [r for r, per in t["chosen_by_link"].items() if per[str(tokens)] == c["name"]]
        lines.append(f"    {c['name']:<34} {c['wire_bytes_per_token']:>6} B/token ({c['bytes_ratio']:.2f} of raw)  "
                     f"train {c['quality_train']:.3f}  test {c['quality_test']:.3f}  "
                     f"{'meets' if c['meets_rule'] else 'fails'}  TTFT ms {ttft}"
                     + (f"  fastest at {', '.join(fastest)} Gbit/s" if fastest else ""))
    if t.get("layered"):
        chosen = t["layered"]["chosen"]
        what = "raw (not offered)" if chosen["codec"] == "raw" else f"int4 at layers {chosen['int4'] or 'none'}, the rest int8"
        lines.append(f"    per-layer codec: {what} ({chosen['why']}; {t['layered']['raw_nats']:.4f} nats raw, "
                     f"bound {t['layered']['bound_nats']:.4f})")
    return lines


def run_translated(job: ProfileJob, candidates: int | None = None) -> dict[str, Any]:
    """`--translate`: the translator is the translated pair's profile. Fit on the contexts of
    `job.n_train` zoo task train rows (reading the lowest `candidates` source layers; None: the fit's default),
    score on `job.n_test` test rows, write the translator under `job.translators_dir` and the JSON.
    A bad task, device or model pair raises a DroidMeshError or ValueError before anything is written."""
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.profiling.translate_fit import profile_translated
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    sender, receiver = job.sender, job.receiver
    spec = task_spec(job.task)
    # the distinct contexts of the train rows: a document asked about twice adds no calibration text
    train = list(dict.fromkeys(r["context"] for r in make_rows(job.task, "train", job.n_train, SuiteShape())))
    test = make_rows(job.task, "test", job.n_test, SuiteShape())
    source = load_model(sender.path, device=job.device, dtype=job.dtype)
    target = load_model(receiver.path, device=job.device, dtype=job.dtype)
    result = profile_translated(source, target, train, test, spec, job.translators_dir / f"{job.pair.id}.safetensors",
                                weights=(sender.sha256, receiver.sha256),
                                **({"candidates": candidates} if candidates else {}))
    result["models"] = {"sender": sender.label, "receiver": receiver.label, "sender_sha256": sender.sha256,
                        "receiver_sha256": receiver.sha256}
    out = Path(job.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def translated_lines(job: ProfileJob, result: dict[str, Any]) -> list[str]:
    """What the translator's fit cost and weighs, then its table (`format_translated`)."""
    info = result["translator"]
    return [f"{job.pair.id} on {job.task}: translator fit on {info['contexts']} contexts ({info['tokens']} tokens) in "
            f"{result['fit_s']:.1f}s, {result['translator_bytes'] / 1e6:.2f} MB, sha256 {result['translator_sha256'][:16]}",
            format_translated(result)]


def format_translated(ev: dict) -> str:
    """The translated pair's paths: quality, TTFT and the share of full prefill's cost saved."""
    lines = [f"{ev['task']} ({ev['metric']}, {ev['rows']} rows), translated from source layers {ev['source_layers']}",
             f"{'path':34s} {'quality':>8s} {'ttft_ms':>8s} {'saved':>6s} {'fidelity':>8s}  vs full prefill, 95 %"]
    for name in ("sender_alone", "receiver_alone_without_context", "receiver_full_prefill", "translated",
                 *(k for k in ev if k.startswith("translated_recompute"))):
        r = ev[name]
        ttft = f"{r['ttft_s'] * 1e3:8.1f}" if "ttft_s" in r else f"{'':8s}"
        saved = f"{r['prefill_cost_saved']:6.1%}" if "prefill_cost_saved" in r else f"{'':6s}"
        fidelity = f" {r['fidelity']:8.4f}" if "fidelity" in r else f" {'':8s}"  # against the target's own full prefill
        lines.append(f"{name:34s} {r['quality']:8.4f} {ttft} {saved}{fidelity}  {versus_text(r.get('vs_full_prefill'))}".rstrip())
    lines.append(f"translation compute {ev['translation_share']:.1%} of full prefill; bytes moved "
                 f"{ev['bytes_moved']['source_e'] / 1e6:.2f} MB of source E (the target's own KV: "
                 f"{ev['bytes_moved']['target_kv'] / 1e6:.2f} MB)")
    return "\n".join(lines)
