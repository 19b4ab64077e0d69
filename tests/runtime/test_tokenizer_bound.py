"""The prompt length bound that lets the server refuse a prompt beyond the context without
tokenizing it: never more tokens than the text really takes, and large enough to refuse a huge
prompt from its length alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smol_folder: str) -> Tokenizer:
    return Tokenizer(smol_folder)


TEXTS = st.one_of(st.text(max_size=300), st.text(alphabet="ab ", max_size=300), st.sampled_from([
    "<|im_start|>" * 20, " " * 500, "\n" * 300, "日本語のテキスト" * 30, "🙂" * 100, "aaaaaaaa" * 80]))


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_the_bound_never_exceeds_the_real_token_count(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.min_num_tokens(text) <= len(tokenizer.encode(text))


def test_a_huge_prompt_is_bounded_beyond_a_context(tokenizer: Tokenizer) -> None:
    assert tokenizer.max_token_chars is not None
    assert tokenizer.min_num_tokens("word " * 200_000) >= 8192
