"""`kvpilot generate`: run prompts through the engine offline and print the completions."""

from __future__ import annotations

import argparse
import json
import sys

from kvpilot.runtime.args import EngineArgs, add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for sampling")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpilot.runtime import LLM, SamplingParams
    from kvpilot.runtime.model_source import ModelSourceError

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("kvpilot generate: error: no prompts given", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
        engine_args = EngineArgs.from_cli(args)
        llm = LLM.from_engine_args(engine_args)
    except (ValueError, ModelSourceError) as exc:
        print(f"kvpilot generate: error: {exc}", file=sys.stderr)
        return 2
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(completion.text)
    return 0
