"""``attnrewrite generate MODEL [REWRITTEN] --tokenizer tokenizer.json --prompt TEXT``: continue
prompts with a decoder (and with its rewrite, to compare), print each model's text per prompt
and what a token cost. The tokenizer comes from the ``tokenizers`` package (the [text] extra)."""

from __future__ import annotations

import argparse

import numpy as np

from attnrewrite.cli_parsing import CommandParser, parse_positive, parse_positive_number
from attnrewrite.data import load_tokenizer
from attnrewrite.errors import AttnRewriteError
from attnrewrite.generate import PADDINGS, Generation, generate
from attnrewrite.record import format_bytes

DEFAULT_MAX_NEW_TOKENS = 20


def build_generate_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="attnrewrite generate",
        description="Continue prompts with a decoder ONNX model (a KV-cache export or a recurrent-state rewrite; "
        "input_ids, attention_mask and past_key_values.* in, logits and present.* out), and with a second "
        "model on the same prompts to compare.",
    )
    parser.add_argument("model", help="the decoder ONNX model")
    parser.add_argument("rewritten", nargs="?", help="a second model to continue the same prompts with")
    parser.add_argument("--tokenizer", required=True, metavar="tokenizer.json", help="the models' tokenizer")
    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt; repeat for a batch")
    parser.add_argument(
        "--max-new-tokens",
        type=parse_positive,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help="tokens to add per prompt at most (default: %(default)s)",
    )
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TOKEN", help="a token that ends a prompt's text"
    )
    parser.add_argument("--sample", action="store_true", help="sample the next token instead of taking the likeliest")
    parser.add_argument("--temperature", type=parse_positive_number, metavar="T", help="with --sample (default: 1)")
    parser.add_argument("--top-k", type=parse_positive, metavar="K", help="with --sample: draw among the K likeliest")
    parser.add_argument("--seed", type=int, metavar="S", help="with --sample (default: 0)")
    parser.add_argument(
        "--padding",
        choices=PADDINGS,
        default="left",
        help="the side prompts of different lengths are padded on: left (transformers) or right (onnxruntime-genai) "
        "(default: %(default)s)",
    )
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime execution provider")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks")
    return parser


def generate_command(args) -> int:
    sampling = {"--temperature": args.temperature, "--top-k": args.top_k, "--seed": args.seed}
    given = [flag for flag, value in sampling.items() if value is not None]
    if given and not args.sample:
        raise AttnRewriteError(f"{given[0]} is a setting of sampling; give --sample too")
    tokenizer = load_tokenizer(args.tokenizer, "generate")
    prompts = [_encode(tokenizer, text) for text in args.prompt]
    stops = [_token_id(tokenizer, token, args.tokenizer) for token in args.stop]
    models = [args.model] + ([args.rewritten] if args.rewritten else [])
    results = {
        model: generate(
            model,
            prompts,
            args.max_new_tokens,
            do_sample=args.sample,
            temperature=args.temperature or 1.0,
            top_k=args.top_k,
            seed=args.seed or 0,
            eos_token_id=stops,
            padding=args.padding,
            provider=args.provider,
        )
        for model in models
    }
    width = max(map(len, models))
    for row, text in enumerate(args.prompt):
        print(f"prompt {row + 1}: {text}")
        for model, result in results.items():
            print(f"  {model:<{width}}  {tokenizer.decode(_until_stop(result.tokens[row], stops))}")
    for model, result in results.items():
        print(f"{model:<{width}}  {_costs(result)}")
    return 0


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text).ids
    if not ids:
        raise AttnRewriteError(f"--prompt {text!r} makes no tokens")
    return ids


def _token_id(tokenizer, token: str, path: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise AttnRewriteError(f"--stop {token!r} is not a token of {path}")
    return token_id


def _until_stop(tokens: np.ndarray, stops: list[int]) -> list[int]:
    """A row's new tokens up to its first stop token, which is kept (the pads after it are not)."""
    ends = np.flatnonzero(np.isin(tokens, stops))
    return tokens[: ends[0] + 1 if ends.size else len(tokens)].tolist()


def _costs(result: Generation) -> str:
    steps = f"{result.ms_per_token:.2f} ms per token (median of {len(result.step_ms)})" if result.step_ms else ""
    return ", ".join(
        part
        for part in (f"prefill {result.prefill_ms:.2f} ms", steps, f"state {format_bytes(result.state_bytes)}")
        if part
    )
