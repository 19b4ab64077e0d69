"""Tokenizer access and incremental detokenization.

Decoding a growing token list one token at a time is wrong for byte-level BPE (a character can
span tokens) and quadratic if redone from the start; like vLLM we decode a short window
`[prefix_offset:]` and emit only what extends the already-read text, holding back a trailing
replacement character until the next token completes it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.errors import RequestError

if TYPE_CHECKING:  # the base layer sits below the bookkeeping; only the annotation needs it
    from kvpilot.runtime.sched.sequence import Sequence


# The tokenizer classes that AutoTokenizer resolves to transformers' generic fast tokenizer (built
# from tokenizer.json) for a model of these types. AutoTokenizer itself imports torch and reads the
# model's config to decide (seconds of the API process's start-up); for these the class is loaded
# directly, the same object AutoTokenizer would return. Any other folder goes through AutoTokenizer.
_GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
_GENERIC_MODEL_TYPES = frozenset({"llama"})


def loads_as_generic(folder: Path) -> bool:
    """The folder's tokenizer is transformers' generic fast tokenizer, whatever loads it."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (config.get("tokenizer_class") in _GENERIC_CLASSES and "auto_map" not in config
            and model_type in _GENERIC_MODEL_TYPES and (folder / "tokenizer.json").is_file())


def _hf_tokenizer(folder: str) -> Any:
    if loads_as_generic(Path(folder)):
        from transformers import PreTrainedTokenizerFast  # TokenizersBackend under its older name

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class Tokenizer:
    def __init__(self, folder: str) -> None:
        self.hf = _hf_tokenizer(folder)
        self.eos_token_ids = self._eos_ids(Path(folder))
        self._token_texts: dict[int, str] = {}  # convert_id's: at most one entry a vocabulary id

    def _eos_ids(self, folder: Path) -> set[int]:
        ids = self.generation_eos_ids(folder)
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        return ids

    @staticmethod
    def generation_eos_ids(folder: Path) -> set[int]:
        """The end-of-sequence ids generation_config.json names."""
        gen = folder / "generation_config.json"
        if not gen.is_file():
            return set()
        eos = json.loads(gen.read_text()).get("eos_token_id")
        return set([eos] if isinstance(eos, int) else (eos or []))

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, where that bounds a text's token
        count from below: a vocabulary without a normalizer, whose token strings are at least as
        long as the text they decode to (byte-level BPE: one character a byte; sentencepiece: the
        text with "▁" for spaces); None where a normalizer may shrink the text first."""
        if self.hf.backend_tokenizer.normalizer is not None:
            return None
        vocab = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
        return max((len(t) for t in vocab if t), default=1)

    def min_num_tokens(self, text: str) -> int:
        """At least this many tokens encode `text` (0 where no bound is known): a prompt beyond the
        context is refused from its length alone, before the work of tokenizing it."""
        chars = self.max_token_chars
        return len(text) // chars if chars else 0

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        if chat_template is None and not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use completions (or pass chat_template "
                             "to a server started with --trust-request-chat-template)")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, **kwargs)
        return str(text)

    def convert_id(self, token_id: int) -> str:
        """One token's text, as `Logprob.decoded_token` and the server's logprobs show it: " Paris",
        not the vocabulary's byte-level spelling "ĠParis"."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.hf.decode([token_id], skip_special_tokens=False))
        return text

    def detokenize_step(self, seq: Sequence) -> str:
        """Append the text of `seq`'s newest token to `seq.text`; return the new characters."""
        if seq.read_offset == 0 and seq.prefix_offset == 0:
            # start from the end of the prompt, with a few prompt tokens as context
            seq.read_offset = seq.num_prompt_tokens
            seq.prefix_offset = max(0, seq.num_prompt_tokens - 5)
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        if skip and ids[-1] in self.hf.all_special_ids:
            return ""
        prefix = self.decode(ids[seq.prefix_offset:seq.read_offset], skip)
        full = self.decode(ids[seq.prefix_offset:], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)
            seq.text += new
            return new
        return ""


def eos_token_ids(folder: str) -> set[int]:
    """`Tokenizer(folder).eos_token_ids`, from the folder's files without loading the tokenizer (which
    imports transformers: seconds that `kvpilot serve`'s engine core, given token ids only, would
    spend before it is ready): the eos token of tokenizer_config.json looked up as the tokenizer
    looks it up (added tokens, then the vocabulary of tokenizer.json), plus generation_config.json's.
    Folders laid out otherwise load the tokenizer."""
    path = Path(folder)
    try:
        eos = json.loads((path / "tokenizer_config.json").read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        fast = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return Tokenizer(folder).eos_token_ids
    ids: set[int] = set()
    if eos is not None:
        by_token = {t["content"]: t["id"] for t in fast.get("added_tokens", [])}
        found = by_token.get(eos, (fast.get("model") or {}).get("vocab", {}).get(eos))
        if not isinstance(found, int):
            return Tokenizer(folder).eos_token_ids
        ids.add(found)
    return ids | Tokenizer.generation_eos_ids(path)


def load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The tokenizer of `config`'s model, or None for a model without one; ready for serving: the
    length bound of `min_num_tokens` is computed now, not on the event loop at the first request."""
    folder = config.model.tokenizer
    if not folder:
        return None
    tokenizer = Tokenizer(folder)
    _ = tokenizer.max_token_chars
    return tokenizer


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raises `RequestError` for a prompt the engine cannot take: empty, leaving no room in the
    context for a generated token, or with a token id outside the vocabulary."""
    if not token_ids:
        raise RequestError("the prompt is empty")
    if len(token_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(token_ids)} tokens; this model's maximum context length is {max_model_len} "
            "tokens, which must also leave room for at least one generated token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text or as token ids; text needs a tokenizer."""
    if not isinstance(prompt, str):
        return None, list(prompt)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer: pass prompt_token_ids instead of text")
    return prompt, tokenizer.encode(prompt)
