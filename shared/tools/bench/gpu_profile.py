"""The real tier's profile on a GPU, timed (`infra/gpu/profile-check.sh`): `droidmesh profile
--search fidelity` of a SmolLM2-135M pair on the real tier's doc_qa rows, announced, then run.

The real weights (~98 MB packed, 517 MB unpacked) cannot travel to the GPU machine with the tree,
so the pair is made there: checkpoints of the real shape without weights (`zoo/shapes.py`,
random-initialised on the device at load, seeds 0 and 1) with the real tokenizer, from `--like`, a
directory holding the real base's tokenizer files (~3.5 MB, carried; `--prepare` copies them).
The rows' token counts, and so the time, are the real pair's; the choice and its verdicts mean
nothing (random models score 0 on the task, so the race cannot drop a plan and every plan runs
every train row: the worst case of the search's cost). On the CPU, `--tiny` runs the same
sequence with the 8-layer toy shape on a few rows (what CI runs).

Writes one JSON: the device, the shape, rows, the announced and measured seconds (their ratio),
the measured per-row timings, and the profile's own `cost` and `fidelity` sections.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SHAPE = "smollm2-135m"  # the real tier's architecture (shared/model/shapes.py)


def random_pair(like: Path, work: Path, *, tiny: bool) -> tuple[Path, Path]:
    """Two checkpoints of the real shape (`tiny`: the 8-layer toy) without weights, `like`'s
    tokenizer, random-initialised at load from seeds 0 (sender) and 1 (receiver)."""
    from droidmesh.shared.zoo.shapes import write_checkpoint

    if not (like / "tokenizer.json").is_file():
        raise SystemExit(f"--like {like}: no tokenizer.json (run `bash infra/gpu/profile-check.sh --prepare` and carry it)")
    shape = "tiny" if tiny else SHAPE
    return (write_checkpoint(shape, work / "sender", seed=0, tokenizer=like),
            write_checkpoint(shape, work / "receiver", seed=1, tokenizer=like))


def run(like: Path, work: Path, *, tiny: bool, device: str, dtype: str | None, n_train: int, n_test: int,
        task: str = "doc_qa") -> dict[str, Any]:
    from droidmesh.shared.profiling import fidelity
    from droidmesh.shared.profiling.profile import ProfileSettings, profile_checkpoints
    from droidmesh.shared.zoo.manifest import resolve_model

    sender, receiver = random_pair(like, work, tiny=tiny)
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        print(line, file=sys.stderr, flush=True)

    probe = fidelity.Settings(probe_rows=2, batch=2, min_rows=4) if tiny else fidelity.Settings()
    settings = ProfileSettings(search="fidelity", require_signal=False, fidelity=probe)
    began = time.perf_counter()
    result, _ = profile_checkpoints(resolve_model(str(sender), name="sender"), resolve_model(str(receiver), name="receiver"),
                                    task, settings, n_train=n_train, n_test=n_test, device=device, dtype=dtype,
                                    other_tasks=[], say=say)
    wall = time.perf_counter() - began
    c = result["cost"]
    return {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "task": task,
            "shape": "tiny" if tiny else SHAPE, "layers": result["total_layers"],
            "rows": result["rows"], "announced": said[0] if said else None, "estimated_s": c["estimated_s"],
            "elapsed_s": c["elapsed_s"], "wall_s": wall, "elapsed_over_estimated": c["elapsed_s"] / c["estimated_s"],
            "measured_per_row_s": c["measured_s"], "row_evaluations": c["row_evaluations"],
            "fidelity": {k: result["fidelity"][k] for k in ("shortlist", "race_rows", "race_row_scores")},
            "torch": torch.__version__}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.gpu_profile")
    parser.add_argument("--like", required=True, type=Path, help="a directory with the real base's tokenizer files")
    parser.add_argument("--tiny", action="store_true", help="an 8-layer shape on the CPU, few rows (what CI runs)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument("--dtype", default=None, help="default: the device's (bfloat16 on cuda)")
    parser.add_argument("--n-train", type=int, default=None, help="default 64 (--tiny: 4)")
    parser.add_argument("--n-test", type=int, default=None, help="default 200 (--tiny: 2)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dm-gpu-profile"), help="where the pair is written")
    a = parser.parse_args(argv)
    device = a.device or ("cpu" if a.tiny else "cuda")
    a.work.mkdir(parents=True, exist_ok=True)
    report = run(a.like, a.work, tiny=a.tiny, device=device, dtype=a.dtype,
                 n_train=a.n_train or (4 if a.tiny else 64), n_test=a.n_test or (2 if a.tiny else 200))
    print(f"profile on {report['device']}: {report['rows']['train']} train + {report['rows']['test']} test rows, "
          f"announced {report['estimated_s']:.0f} s, took {report['elapsed_s']:.0f} s "
          f"({report['elapsed_over_estimated']:.2f} of the announcement)")
    if a.out:
        a.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
