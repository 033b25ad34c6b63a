"""README's "Which method?" table, regenerated from two runs' files: the fidelity of every method
on all-MiniLM-L6-v2 (bench/fidelity.json, one run of ``python bench/fidelity.py``) and the
speed of attention alone (bench/attention_rows.json). Each figure comes from those files and
the text above the table says which run, machine and command made them.

    python bench/run_benchmarks.py --lengths 1024,4096 --rows-json bench/attention_rows.json \
        --attention-rows softmax,linear,hydra,favor:features=256,favor:features=256+window=32,\
hedgehog:window=32,hedgehog,lsh,nystrom,efficient,aft:variant=local+span=16
    python bench/readme_table.py            # rewrite README.md's table in place
    python bench/readme_table.py --check    # exit 1 if README.md's table is not what the files give
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARKERS = ("<!-- WHICH METHOD -->", "<!-- /WHICH METHOD -->")
SPEED_LENGTHS = (1024, 4096)
# (README's label, bench/fidelity.py's configuration, the speed run's variant)
ROWS = [
    ("`linear`", "linear", "linear"),
    ("`hydra`", "hydra", "hydra"),
    ("`favor` (256 features)", "favor-m256", "favor:features=256"),
    ("`favor` + `window=32`", "favor-m256+window32", "favor:features=256,window=32"),
    ("`hedgehog` + `window=32`", "hedgehog+window32", "hedgehog:window=32"),
    ("`hedgehog`", "hedgehog", "hedgehog"),
    ("`linformer` (k=64)", "linformer-k64", None),
    ("`lsh`", "lsh", "lsh"),
    ("`nystrom` (64 landmarks)", "nystrom-m64", "nystrom"),
    ("`efficient`", "efficient", "efficient"),
    ("`aft` (`variant=local`, `span=16`)", "aft-local16", "aft:variant=local,span=16"),
]


def fidelity_cell(fidelity: dict, config: str, mode: str) -> str:
    row = fidelity["rows"].get(f"{config}/{mode}")
    if row is None:
        why = fidelity.get("not_run", {}).get(f"{config}/{mode}")
        return "nothing to fit" if why and "nothing to fit" in why else "not measured"
    return f"{row['mean_cosine']:.3f} / {row['nn_agreement']:.2f}"


def speed_cell(speed: dict, variant: str | None) -> str:
    rows = speed["rows"]
    if variant is None or variant not in rows:
        return "not in this run"
    ratios = []
    for n in SPEED_LENGTHS:
        ours, softmax = rows[variant].get(str(n)), rows["softmax"].get(str(n))
        ratios.append("-" if ours is None or softmax is None else f"{softmax['median_ms'] / ours['median_ms']:.2f}x")
    return " / ".join(ratios)


def one_run(fidelity: dict) -> str:
    """The fidelity run's commit, refusing a file whose rows come from several runs."""
    commits = {row["commit"] for row in fidelity["rows"].values()}
    if len(commits) != 1:
        raise SystemExit(f"bench/fidelity.json holds rows of {len(commits)} commits: README's table takes one run")
    return commits.pop()


def section(fidelity: dict, speed: dict) -> str:
    commit, machine = one_run(fidelity), speed["machine"]
    lengths = " / ".join(map(str, SPEED_LENGTHS))
    lines = [
        "Measured, not promised. Fidelity: all-MiniLM-L6-v2 (trained), all 6 layers replaced, "
        f"{fidelity['heldout_passages']} held-out passages of 128-256 tokens never used for calibration: mean "
        "embedding cosine with the original / nearest-neighbour agreement, zero-shot and after `--calibrate` on "
        f"304 other passages (defaults), one run of `python bench/fidelity.py` ({fidelity['date']}, commit "
        f"{commit}; [bench/FIDELITY.md](bench/FIDELITY.md): figures that do not depend on the machine). Speed: "
        f"attention alone ([1, 12, N, 64], fp32, {speed['threads']} threads), speedup over onnxruntime's softmax "
        f"at N = {lengths}, one run of `{speed['command']}` ({machine['time'][:10]}, {machine['cpu']}, "
        f"{machine['cores']} cores, onnxruntime {machine['versions']['onnxruntime']}; bench/attention_rows.json).",
        "",
        f"| method | zero-shot | calibrated | CPU, attention alone: speedup at N={lengths} |",
        "|---|---|---|---|",
    ]
    for label, config, variant in ROWS:
        lines.append(
            f"| {label} | {fidelity_cell(fidelity, config, 'zero-shot')} | "
            f"{fidelity_cell(fidelity, config, 'calibrated')} | {speed_cell(speed, variant)} |"
        )
    return "\n".join(lines)


def replaced(text: str, body: str) -> str:
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    return f"{text[:start]}\n{body}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fidelity", type=Path, default=HERE / "fidelity.json")
    parser.add_argument("--speed", type=Path, default=HERE / "attention_rows.json")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 where README.md differs from the files")
    args = parser.parse_args(argv)
    body = section(json.loads(args.fidelity.read_text()), json.loads(args.speed.read_text()))
    text = args.readme.read_text()
    new = replaced(text, body)
    if args.check:
        if new != text:
            print(f"{args.readme}: the Which method? table is not what {args.fidelity} and {args.speed} give")
            return 1
        return 0
    args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
