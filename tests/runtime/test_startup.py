"""Start-up bookkeeping: the phase record's clock, the work left for after Ready and its pacing,
the weight readers (bytes from disk, whichever reads them, fill the same model), and the checks
that keep a start from failing on a cache it cannot write or a CUDA probe that imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvpilot.runtime import caches
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.engine.warm_up import WarmUp
from kvpilot.runtime.executor.loader import load_model
from kvpilot.runtime.executor.weight_reader import choose_reader
from kvpilot.runtime.startup import StartupLog, process_start_time, startup_record


def test_process_start_is_the_kernels_record_and_phases_are_placed_after_it() -> None:
    started = process_start_time()
    assert time.time() - 3600 < started < time.time()
    child = subprocess.run([sys.executable, "-c", "from kvpilot.runtime.startup import process_start_time as p;"
                            "import time; print(time.time() - p())"], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert 0 <= float(child.stdout) < 30  # a fresh interpreter: its own start, not ours
    log = StartupLog("core")
    with log.phase("b", bytes=3) as details:
        details["more"] = 1
    with log.phase("a"):
        pass
    record = startup_record(log.phases[0].start - 1.0, log.phases[1].start + 1.0,
                            [*log.as_list(), {"name": "x", "process": "api", "start": log.phases[0].start - 0.5,
                                              "seconds": 0.1}])
    assert [p["name"] for p in record["phases"]] == ["x", "b", "a"]
    assert record["phases"][0]["start_s"] == pytest.approx(0.5, abs=1e-3)
    assert record["phases"][1]["bytes"] == 3 and record["phases"][1]["more"] == 1
    assert record["ready_s"] == pytest.approx(log.phases[1].start + 1.0 - log.phases[0].start + 1.0, abs=1e-3)


def test_work_after_ready_runs_one_unit_at_a_time_and_the_idle_pass_waits_for_idle() -> None:
    done: list[str] = []

    def units():
        for i in range(3):
            done.append(f"unit {i}")
            yield f"unit {i}"

    warm_up = WarmUp(units(), lambda: done.append("pass"), idle_first=[("swap", lambda: done.append("swap"))])
    warm_up.run_one(idle=False)
    assert done == ["unit 0"] and warm_up.pending  # busy: the idle-first work waits, a unit runs
    warm_up.run_if_due(idle=False)  # busy: not again within BUSY_INTERVAL_S
    assert done == ["unit 0"]
    warm_up.run_one(idle=True)
    assert done == ["unit 0", "swap"]  # idle: before the remaining units
    for _ in range(5):
        warm_up.run_one(idle=False)
    assert done == ["unit 0", "swap", "unit 1", "unit 2"] and warm_up.pending  # the pass needs an idle engine
    warm_up.run_one(idle=True)
    assert done[-1] == "pass" and not warm_up.pending
    warm_up.run_one(idle=True)
    assert done.count("pass") == 1


def test_weight_readers_fill_the_same_model(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny_models["qwen2"]
    config = ModelConfig(model=folder, served_model_name="t", load_format="safetensors")
    readers = ["safetensors"] + (["fastsafetensors"] if choose_reader_installed() else [])
    models = {}
    for reader in readers:
        monkeypatch.setenv("KVPILOT_WEIGHT_READER", reader)
        log = StartupLog("core")
        models[reader], _ = load_model(config, "cpu", startup=log)
        weights = next(p for p in log.phases if p.name == "weights")
        assert weights.details == {"reader": reader, "bytes": sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))}
    first = dict(models["safetensors"].named_parameters())
    for reader in readers[1:]:
        for name, param in models[reader].named_parameters():
            assert torch.equal(param, first[name]), (reader, name)


def choose_reader_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("fastsafetensors") is not None


def test_read_ahead_starts_once_per_file_and_skips_a_folder_without_a_checkpoint(
        tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.runtime.executor import checkpoint_files

    advised: list[list[Path]] = []
    monkeypatch.setattr(checkpoint_files, "_advise", advised.append)
    monkeypatch.setattr(checkpoint_files, "_asked", set())
    folder, _ = tiny_models["llama"]
    files = checkpoint_files.checkpoint_files(Path(folder))
    checkpoint_files.read_ahead_folder(folder)
    checkpoint_files.read_ahead_folder(folder)  # the engine core, then the weight reader: once
    checkpoint_files.read_ahead_folder(str(tmp_path))  # no checkpoint: the loader says so, not this
    checkpoint_files.read_ahead_folder("llama-3-8b")  # a preset name
    for _ in range(100):
        if advised:
            break
        time.sleep(0.01)
    time.sleep(0.1)  # a second thread, were one started, has had its time
    assert advised == [files]


def test_reader_choice_is_checked_and_auto_is_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_WEIGHT_READER", raising=False)
    assert choose_reader() == "safetensors"
    monkeypatch.setenv("KVPILOT_WEIGHT_READER", "mmap")
    with pytest.raises(ValueError, match="KVPILOT_WEIGHT_READER='mmap': must be one of auto, safetensors"):
        choose_reader()


def test_an_unwritable_cache_is_replaced_by_a_private_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("KVPILOT_CACHE", str(blocked))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    caches.ensure_writable_caches()
    assert os.environ["KVPILOT_CACHE"] != str(blocked) and Path(os.environ["KVPILOT_CACHE"]).is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")  # writable: kept
    assert "KVPILOT_CACHE: cannot write" in caplog.text


def test_cuda_probe_agrees_with_torch_without_importing_it() -> None:
    code = ("import sys; from kvpilot.runtime.cuda_probe import cuda_available; a = cuda_available();"
            "print(a, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout.split()
    assert out == [str(torch.cuda.is_available()), "False"]


def test_eos_ids_read_from_the_files_equal_the_loaded_tokenizers(smol_folder: str, tmp_path: Path) -> None:
    import json
    import shutil

    from kvpilot.runtime.tokenizer import Tokenizer, eos_token_ids

    assert eos_token_ids(smol_folder) == Tokenizer(smol_folder).eos_token_ids
    # an eos token named only by its added-token entry, and a generation config adding another
    folder = tmp_path / "tok"
    shutil.copytree(smol_folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_token_ids(str(folder)) == Tokenizer(str(folder)).eos_token_ids


def test_the_embedded_tokenizer_is_autotokenizers_without_importing_torch(smol_folder: str, tmp_path: Path) -> None:
    import json
    import shutil

    from transformers import AutoTokenizer

    from kvpilot.runtime.tokenizer import Tokenizer

    code = ("import sys; from kvpilot.runtime.tokenizer import Tokenizer; t = Tokenizer(sys.argv[1]);"
            "print(type(t.hf).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, smol_folder], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout.split()
    auto = AutoTokenizer.from_pretrained(smol_folder)
    assert out == [type(auto).__name__, "False"]
    ours = Tokenizer(smol_folder).hf
    assert type(ours) is type(auto)
    for text in ("Hello world", "  spaces, ünïcödé 日本語 🎉", "<|im_start|>user\nhi<|im_end|>", "a\n\n\tb"):
        ids = auto.encode(text)
        assert ours.encode(text) == ids, text
        assert [ours.decode(ids, skip_special_tokens=s) for s in (True, False)] == \
            [auto.decode(ids, skip_special_tokens=s) for s in (True, False)]
    assert (ours.all_special_ids, ours.special_tokens_map) == (auto.all_special_ids, auto.special_tokens_map)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # a model type whose tokenizer class AutoTokenizer picks by itself goes through AutoTokenizer
    folder = tmp_path / "qwen2"
    shutil.copytree(smol_folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert type(Tokenizer(str(folder)).hf) is type(AutoTokenizer.from_pretrained(folder))
    assert type(Tokenizer(str(folder)).hf) is not type(auto)


def test_the_engine_core_imports_no_triton_before_a_cuda_step_needs_it() -> None:
    """Triton's import is a good part of a second of a CPU start's critical path: the quantized
    formats' kernels load on their first CUDA product."""
    code = ("import sys; import kvpilot.runtime.engine.core, kvpilot.runtime.engine.engine;"
            "from kvpilot.runtime.executor.quant import methods; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout.strip()
    assert out == "False"


def test_kvpilot_serve_imports_no_other_subcommand() -> None:
    code = ("import sys; from kvpilot.runtime.cli import build_parser; build_parser('serve');"
            "print(sorted(m for m in ('kvpilot.operator.cli', 'kvpilot.bench.cli', 'pydantic', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout.strip()
    assert out == "[]"
    usage = subprocess.run([sys.executable, "-m", "kvpilot.runtime.cli", "--help"], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout
    assert all(name in usage for name in ("serve", "bench", "operator", "generate"))
