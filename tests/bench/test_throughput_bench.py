"""`kvpilot bench throughput` on a tiny dummy model: the figures add up, the decode steps are set
against a floor, and bad input is one line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from kvpilot.bench import throughput
from kvpilot.runtime.executor.models.llama import LlamaConfig, LlamaForCausalLM

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}
SHAREGPT = Path(__file__).parent / "data" / "sharegpt-two.json"  # two conversations
SHAREGPT_REPLIES = [c["conversations"][1]["value"] for c in json.loads(SHAREGPT.read_text())]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot bench throughput")
    throughput.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_tiny_dummy_model_reports_throughput_and_the_decode_floor(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "throughput.json"
    args = parse("--model", "tiny-llama", "--load-format", "dummy", "--num-prompts", "12", "--input-len", "20",
                 "--output-len", "16", "--max-num-seqs", "4", "--output", str(out), "--disable-tqdm")
    assert throughput.run(args) == 0
    body = json.loads(out.read_text())
    assert body["num_requests"] == 12
    assert body["total_input_tokens"] == 12 * 20 and body["total_output_tokens"] == 12 * 16
    assert body["output_tokens_per_s"] == pytest.approx(12 * 16 / body["elapsed_s"])
    assert body["total_tokens_per_s"] == pytest.approx(12 * 36 / body["elapsed_s"])
    assert body["requests_per_s"] == pytest.approx(12 / body["elapsed_s"])
    # max_num_seqs 4 caps every decode batch; three waves of four decode 15 steps each
    [step] = [s for s in body["decode_steps"] if s["batch"] == 4]
    assert step["num_steps"] >= 30
    assert 4 * 20 < step["mean_kv_tokens"] < 4 * 36
    assert step["floor_ms"] > 0 and step["of_floor"] == pytest.approx(step["median_ms"] / step["floor_ms"])
    assert all(s["batch"] <= 4 for s in body["decode_steps"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "output tokens/s" in printed and "x floor" in printed


@pytest.mark.parametrize("tied", [False, True])
def test_the_floor_counts_the_weights_a_step_reads_whole(tied: bool) -> None:
    """An untied input embedding is looked up, a few rows a step, not streamed: the floor leaves it
    out (Llama-3-8B's is 1 GiB, a quarter of a millisecond on an H200); a tied one is the LM head."""
    hf = json.loads((resources.files("kvpilot.runtime") / "presets" / "tiny-llama.json").read_text())
    model = LlamaForCausalLM(LlamaConfig.from_hf({**hf, "tie_word_embeddings": tied}))
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    assert model.streamed_weight_bytes() == (every if tied else every - embedding)


def test_a_sharegpt_file_takes_its_replies_lengths_from_the_models_tokenizer(tmp_path: Path) -> None:
    from kvpilot.runtime.model_source import resolve_model
    from kvpilot.runtime.tokenizer import Tokenizer

    out = tmp_path / "throughput.json"
    assert throughput.run(parse("--dataset-path", str(SHAREGPT), "--num-prompts", "2", "--output", str(out),
                                "--disable-tqdm")) == 0
    folder = resolve_model(None).tokenizer
    assert folder is not None
    expected = sum(len(Tokenizer(folder).encode(r)) for r in SHAREGPT_REPLIES)
    assert json.loads(out.read_text())["total_output_tokens"] == expected


def test_sampled_lengths_stay_within_the_range(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    args = parse("--model", "tiny-llama", "--load-format", "dummy", "--num-prompts", "10", "--input-len", "20",
                 "--output-len", "10", "--random-range-ratio", "0.5", "--output", str(out), "--disable-tqdm")
    assert throughput.run(args) == 0
    body = json.loads(out.read_text())
    assert 10 * 10 <= body["total_input_tokens"] <= 10 * 30 and body["total_input_tokens"] != 200
    assert 10 * 5 <= body["total_output_tokens"] <= 10 * 15


@pytest.mark.parametrize(("flags", "named"), [
    (["--input-len", "2000"], "--max-model-len"),
    (["--random-range-ratio", "2"], "--random-range-ratio"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--dataset-path", "/no/such.jsonl"], "/no/such.jsonl"),
])
def test_bad_input_fails_with_one_line(flags: list[str], named: str) -> None:
    result = subprocess.run([KVPILOT, "bench", "throughput", "--model", "tiny-llama", "--load-format", "dummy",
                             "--disable-tqdm", *flags], capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "error" in lines[0], result.stderr
