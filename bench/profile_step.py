"""Where a decoding step's time and bytes go: onnxruntime's profiler on SmolLM2-135M-Instruct's
builder folder (the KV cache) and on its recurrent rewrite, at several contexts.

    python bench/profile_step.py                       # the builder folder and hedgehog window=64
    python bench/profile_step.py --folder recurrent=DIR --contexts 256 1024 8192

Each folder's model.onnx on onnxruntime CPU (2 intra-op threads, as genai is configured by
bench/genai_smollm2.py), fed as genai feeds it: the context's tokens of held-out text in one
call, then --steps greedy tokens, each call given the cache or state the one before returned.
Two sessions per folder and context: one unprofiled, which gives the times, and one with
onnxruntime's profiler, which gives, per step, the nodes run, their kernel time split between
the builder's own nodes (its projections, norms and head, the same in every folder) and the
rest (attention: the operator in the original; the replacement, its rotation and its state's
packing in the rewrite), and the bytes the nodes write (outputs of ops that copy: a Reshape's or
a Squeeze's output is a view and not counted). The profiler adds a few microseconds a node, so
its kernel times are for shares, the unprofiled times for speed. Writes bench/profile_step.md
and bench/profile_step.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from common import shown  # noqa: E402

VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten"}  # ops whose output aliases the input
BUILDER_NODE = re.compile(r"^/(model|lm_head)/")  # the builder's names; GroupQueryAttention is attention
COPYING_AT_LEAST = 64 * 1024  # bytes: the outputs listed as the step's large writes
DEFAULT_STEPS = 16


def node_events(events: list[dict], after: int) -> list[dict]:
    """The profile's node kernels that started after ``after`` (µs), If nodes left out (their
    branches' nodes are listed themselves)."""
    return [
        e
        for e in events
        if e.get("cat") == "Node"
        and e["name"].endswith("_kernel_time")
        and e["ts"] >= after
        and e["args"].get("op_name") != "If"
    ]


def group_name(event: dict) -> str:
    """A node's name without its layer and its numbering, so that every layer's copy of a node
    counts as one row: "/model/layers.3/mlp/up_proj/MatMul" -> "/model/layers.L/mlp/up_proj/MatMul"."""
    name = event["name"][: -len("_kernel_time")]
    return re.sub(r"_\d+", "_#", re.sub(r"layers\.\d+", "layers.L", name))


def written_bytes(event: dict) -> int:
    return 0 if event["args"].get("op_name") in VIEWS else int(event["args"].get("output_size", 0))


def summarise(events: list[dict], calls: int, top: int = 8) -> dict:
    """Per call, over ``calls`` calls of ``events`` (node_events): nodes run, kernel ms (the
    builder's, the rest's), bytes written, and the ``top`` node groups by kernel time and by
    bytes written."""
    kernel, writes, count = collections.Counter(), collections.Counter(), collections.Counter()
    builder_us = 0
    for e in events:
        group = (e["args"].get("op_name"), group_name(e))
        kernel[group] += e["dur"]
        writes[group] += written_bytes(e)
        count[group] += 1
        builder_us += (
            e["dur"] if BUILDER_NODE.match(e["name"]) and e["args"].get("op_name") != "GroupQueryAttention" else 0
        )
    total_us = sum(kernel.values())

    def rows(counter):
        return [
            {
                "op": op,
                "node": name,
                "per_call": count[(op, name)] / calls,
                "ms": kernel[(op, name)] / calls / 1e3,
                "bytes": writes[(op, name)] / calls,
            }
            for (op, name), _ in counter.most_common(top)
        ]

    return {
        "nodes": len(events) / calls,
        "kernel_ms": total_us / calls / 1e3,
        "builder_ms": builder_us / calls / 1e3,
        "attention_ms": (total_us - builder_us) / calls / 1e3,
        "bytes_written": sum(writes.values()) / calls,
        "large_writes": sum(1 for e in events if written_bytes(e) >= COPYING_AT_LEAST) / calls,
        "by_time": rows(kernel),
        "by_bytes": rows(writes),
    }


class Feeder:
    """Feeds ``session`` as genai does: a prompt from an empty cache or a zero state, then one
    token a call with the presents of the call before."""

    def __init__(self, session, head_size: int):
        self.session = session
        self.inputs = {i.name: i for i in session.get_inputs()}
        self.outputs = [o.name for o in session.get_outputs()]
        # the KV cache's past length 0 (its last axis the builder's kv_cache_dim, the head size),
        # a state's own sizes
        sizes = {"batch_size": 1, "kv_cache_dim": head_size}
        self.past = {
            name: np.zeros([sizes.get(d, 0) if isinstance(d, str) else d for d in i.shape], np.float32)
            for name, i in self.inputs.items()
            if name.startswith("past_")
        }
        self.length = 0

    def call(self, ids: list[int]) -> int:
        """The greedy next token after ``ids``."""
        self.length += len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, self.length), np.int64)}
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(self.length - len(ids), self.length)[None]
        results = dict(zip(self.outputs, self.session.run(None, {**feeds, **self.past})))
        self.past = {
            "past_key_values" + name[len("present") :]: v for name, v in results.items() if name.startswith("present")
        }
        return int(results["logits"][0, -1].argmax())


def session(path: Path, profile_prefix: str | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def head_size(path: Path) -> int:
    """The decoder's head size, from the genai_config.json beside ``path``."""
    return json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"]


def timed(path: Path, context: list[int], steps: int) -> dict:
    """Unprofiled: the prompt's call (s) and the median step (ms)."""
    feeder = Feeder(session(path), head_size(path))
    start = time.perf_counter()
    token = feeder.call(context)
    prompt_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = feeder.call([token])
        times.append(time.perf_counter() - start)
    return {"prompt_s": round(prompt_s, 3), "step_ms": round(1e3 * statistics.median(times), 2)}


def profiled(path: Path, context: list[int], steps: int, folder: Path) -> dict:
    """The profile's summaries of the prompt's call and of the steps after it."""
    feeder = Feeder(session(path, str(folder / "profile")), head_size(path))
    token = feeder.call(context)
    for _ in range(steps):
        token = feeder.call([token])
    events = json.loads(Path(feeder.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    prompt_end = runs[0]["ts"] + runs[0]["dur"]
    prompt = [e for e in node_events(events, 0) if e["ts"] < prompt_end]
    return {"prompt": summarise(prompt, 1), "step": summarise(node_events(events, prompt_end), len(runs) - 1)}


def measure(folders: dict[str, Path], contexts: list[int], steps: int, tokens: list[int], log=print) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for length in contexts:
            context = (tokens * (length // len(tokens) + 1))[:length]
            for label, folder in folders.items():
                log(f"profile_step: {label} at {length}")
                row = {"model": label, "context": length, **timed(folder / "model.onnx", context, steps)}
                rows.append(row | profiled(folder / "model.onnx", context, steps, Path(scratch)))
    return rows


def markdown(results: dict) -> str:
    lines = [
        "## Where a decoding step goes: SmolLM2-135M-Instruct, onnxruntime CPU",
        "",
        f"`{shown(results['command'])}` ({results['date']}, {results['machine']['processor']}, "
        f"{results['machine']['cpus']} cores, onnxruntime {results['machine']['onnxruntime']}, commit "
        f"{results['machine']['commit']}): {results['steps']} greedy steps after the context's prompt, one call; "
        "times unprofiled, the rest from onnxruntime's profiler (kernel times inflated by a few µs a node).",
        "",
        "| model | context | step (ms) | nodes run a step | kernel ms: builder's / attention | written a step (MB) | writes >= 64 KB | prompt's call (s) | its kernel ms: builder's / attention |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        step, prompt = r["step"], r["prompt"]
        lines.append(
            f"| {r['model']} | {r['context']} | {r['step_ms']:.1f} | {step['nodes']:.0f} | "
            f"{step['builder_ms']:.1f} / {step['attention_ms']:.1f} | {step['bytes_written'] / 1e6:.1f} | "
            f"{step['large_writes']:.0f} | {r['prompt_s']:.2f} | {prompt['builder_ms']:.0f} / {prompt['attention_ms']:.0f} |"
        )
    contexts = [r["context"] for r in results["rows"]]
    for r in results["rows"]:
        if r["context"] not in (min(contexts), max(contexts)):  # the largest writes at the ends only
            continue
        lines += ["", f"{r['model']} at {r['context']}, a step's largest writes (node, every layer's together):", ""]
        lines += ["| op | node | per step | MB | kernel ms |", "|---|---|---:|---:|---:|"]
        for row in r["step"]["by_bytes"]:
            if row["bytes"]:
                lines.append(
                    f"| {row['op']} | `{row['node']}` | {row['per_call']:.0f} | {row['bytes'] / 1e6:.2f} | {row['ms']:.2f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import fidelity  # machine()
    import smollm2_fidelity
    from genai_smollm2 import builder_folder, context_tokens, recurrent_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=smollm2_fidelity.DEFAULT_CACHE)
    parser.add_argument("--folder", action="append", default=[], metavar="LABEL=DIR", help="a folder to profile")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 8192])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--json", type=Path, default=HERE / "profile_step.json")
    parser.add_argument("--markdown", type=Path, default=HERE / "profile_step.md")
    args = parser.parse_args(argv)
    cache = smollm2_fidelity.prepare(args.cache, calibration_texts=96)
    if args.folder:
        folders = dict(item.rsplit("=", 1) for item in args.folder)  # a label may hold "="
        folders = {label: Path(path) for label, path in folders.items()}
    else:
        builder = builder_folder(cache / "model", args.cache / "genai" / "builder")
        recurrent = args.cache / "genai" / "recurrent"
        recurrent_folder(builder, recurrent, cache, "zero-shot", reuse=True)
        folders = {"original (KV cache)": builder, "hedgehog window=64, recurrent": recurrent}
    # the context and its steps within the model's positions (8192 for SmolLM2: "8k" is 8192 - steps - 1)
    limit = min(json.loads((f / "genai_config.json").read_text())["model"]["context_length"] for f in folders.values())
    contexts = [min(c, limit - args.steps - 1) for c in args.contexts]
    tokens = context_tokens(cache, max(contexts))
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": fidelity.machine(),
        "steps": args.steps,
        "command": shlex.join(["python", "bench/profile_step.py", *(sys.argv[1:] if argv is None else argv)]),
        "folders": {label: shown(str(path)) for label, path in folders.items()},
        "rows": measure(folders, contexts, args.steps, tokens),
    }
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    args.markdown.write_text(markdown(results) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
