"""Model folders as onnxruntime-genai reads them: ``genai_config.json``, the decoder's ONNX file
and the tokenizer's files side by side (what its model builder writes and ``og.Model(folder)``
opens).

A folder given as the input names its decoder (its genai_config.json's ``decoder.filename``, or
``model.onnx``). An output folder (``-o DIR/``, the trailing separator saying so; made when missing) gets
``model.onnx`` and a genai_config.json: the input's, everything kept but the decoder's file,
inputs and outputs, or one built from the model and the transformers ``config.json`` /
``generation_config.json`` beside the input; and the tokenizer files of the input's folder (those
it lacks from ``--tokenizer``'s). The input's own folder is never the output's: its files stay as they were.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError, RewriteFailed
from attnrewrite.onnx.io import write_text
from attnrewrite.onnx.state_layout import CONV_STATE, RECURRENT_STATE

CONFIG = "genai_config.json"
DECODER_FILE = "model.onnx"
# what og.Tokenizer reads (tokenizer.json, tokenizer_config.json) and what travels with them
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
_KV_NAMES = ("past_key_names", "past_value_names", "present_key_names", "present_value_names")


def input_model(path: str) -> tuple[str, Path | None]:
    """(the ONNX file to read, the genai folder it came in or None) for a path or a folder."""
    folder = Path(path)
    if not folder.is_dir():
        return path, None
    config = folder / CONFIG
    name = _decoder(_read(config), config).get("filename", DECODER_FILE) if config.is_file() else DECODER_FILE
    model = folder / name
    if not model.is_file() and config.is_file():
        raise AttnRewriteError(f"{path}: its {CONFIG} names the decoder {name}, which is not in the folder")
    if not model.is_file():
        raise AttnRewriteError(f"{path}: is a directory, not an ONNX file (nor a model folder: no {CONFIG}, no {name})")
    return str(model), folder


def output_model(path: str, model: str) -> tuple[str, Path | None]:
    """(the ONNX file to write, the folder to complete for genai or None): ``DIR/``, its trailing
    separator saying so, means a genai folder, made (with its parents) when missing, as genai's
    builder makes its own; never the folder ``model`` (the input) is in."""
    if not path.endswith(("/", os.sep)):
        return path, None
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise AttnRewriteError(f"{path}: is a file, not a folder")
    if folder.resolve() == Path(model).parent.resolve():
        raise AttnRewriteError(f"{path}: is the input model's folder; its files would be overwritten")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file where one of its parents should be, or no permission
        raise AttnRewriteError(f"{path}: cannot make the folder ({error.strerror or error})") from error
    return str(folder / DECODER_FILE), folder


@dataclasses.dataclass(frozen=True)
class FolderFiles:
    """What a genai folder gets beside its model: the config and the tokenizer's files."""

    config: dict
    tokenizer_files: list[Path]

    def write(self, folder: Path) -> list[str]:
        """Write them into ``folder`` (the model is there already); the names written."""
        write_text(folder / CONFIG, json.dumps(self.config, indent=4) + "\n")
        for path in self.tokenizer_files:
            if path.resolve() == (folder / path.name).resolve():
                continue  # --tokenizer named the one already there
            try:
                shutil.copyfile(path, folder / path.name)
            except OSError as error:
                raise RewriteFailed(f"{folder / path.name}: cannot write it ({error.strerror or error})") from error
        return [CONFIG, *(path.name for path in self.tokenizer_files)]


def folder_files(model: ir.Model, source: Path, tokenizer: str | None) -> FolderFiles:
    """The genai_config.json for ``model`` (read from ``source``, the input's folder, or built
    from what lies there) and the tokenizer files to copy: each from the input's folder, else
    from ``tokenizer``'s (a calibration's tokenizer.json may lie alone); AttnRewriteError before
    anything is written where no config can be made."""
    config = _config(model, source)
    folders = [source, *([Path(tokenizer).parent] if tokenizer else [])]  # the model's own first
    files = [next((f / name for f in folders if (f / name).is_file()), None) for name in TOKENIZER_FILES]
    return FolderFiles(config, [path for path in files if path is not None])


def _config(model: ir.Model, source: Path) -> dict:
    """The input's genai_config.json with the decoder's file, inputs and outputs of ``model``,
    or one built from ``model`` and the transformers configs in ``source``."""
    given = source / CONFIG
    config = _read(given) if given.is_file() else _built(model, source)
    decoder = _decoder(config, given)
    decoder["filename"] = DECODER_FILE
    names = {v.name for v in model.graph.inputs}
    inputs = {name: name for name in ("input_ids", "attention_mask", "position_ids") if name in names}
    outputs = {"logits": "logits"}
    if any(name.endswith(f".{RECURRENT_STATE}") for name in names):
        if not any(name.startswith("past_key_values.") and name.endswith(".key") for name in names):
            for key in _KV_NAMES:  # a hybrid (sites left alone keep their caches) keeps them
                decoder.get("inputs", {}).pop(key, None)
                decoder.get("outputs", {}).pop(key, None)
        inputs |= {"past_recurrent_names": f"past_key_values.%d.{RECURRENT_STATE}"}
        inputs |= {"past_conv_names": f"past_key_values.%d.{CONV_STATE}"}
        outputs |= {"present_recurrent_names": f"present.%d.{RECURRENT_STATE}"}
        outputs |= {"present_conv_names": f"present.%d.{CONV_STATE}"}
        # nothing left to share between past and present: the states are returned anew each step
        config.setdefault("search", {})["past_present_share_buffer"] = False
    decoder["inputs"] = {**decoder.get("inputs", {}), **inputs}
    decoder["outputs"] = {**decoder.get("outputs", {}), **outputs}
    return config


def _built(model: ir.Model, source: Path) -> dict:
    """A genai_config.json for a decoder that came without one: its sizes from the
    transformers config.json beside it (or the model itself), its tokens from there and from
    generation_config.json."""
    hf = _optional(source, "config.json")
    if not hf:
        raise AttnRewriteError(
            f"no {CONFIG} and no transformers config.json beside the model (in {source}): a genai folder needs the "
            "model's context length and special tokens from one of them"
        )
    generation = _optional(source, "generation_config.json")
    logits = next((v for v in model.graph.outputs if v.name == "logits"), None)
    vocab = hf.get("vocab_size") or (logits.shape[-1] if logits is not None and logits.shape is not None else None)
    heads = hf.get("num_attention_heads") or hf.get("n_head")
    hidden = hf.get("hidden_size") or hf.get("n_embd")
    layers = hf.get("num_hidden_layers") or hf.get("n_layer") or _layers(model)
    token = lambda name: generation.get(name, hf.get(name))  # noqa: E731
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": DECODER_FILE,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads", heads),
        "hidden_size": hidden,
        "head_size": hf.get("head_dim") or (hidden // heads if hidden and heads else None),
        "inputs": {},
        "outputs": {},
    }
    eos = token("eos_token_id")
    pad = token("pad_token_id")
    found = {
        # genai's plain decoder: the graph holds what is particular to the architecture (rotary,
        # norms), and some of genai's own types expect their cache names (gpt2: past_%d)
        "type": "llama",
        "context_length": hf.get("max_position_embeddings") or hf.get("n_positions"),
        "vocab_size": vocab,
        "bos_token_id": token("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": pad if pad is not None else (eos[0] if isinstance(eos, list) else eos),
    }
    missing = [key for key in ("context_length", "eos_token_id") if found[key] is None]
    if missing:
        raise AttnRewriteError(f"{source / 'config.json'}: says no {', '.join(missing)}, which {CONFIG} needs")
    return {
        "model": {
            **{key: value for key, value in found.items() if value is not None},
            "decoder": {key: value for key, value in decoder.items() if value is not None},
        },
        "search": {"do_sample": False, "num_beams": 1},
    }


def _layers(model: ir.Model) -> int:
    return sum(1 for v in model.graph.inputs if v.name.endswith(f".{RECURRENT_STATE}"))


def _optional(folder: Path, name: str) -> dict:
    return _read(folder / name) if (folder / name).is_file() else {}


def _read(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise AttnRewriteError(f"{path}: cannot read it as JSON ({error})") from error
    if not isinstance(config, dict):
        raise AttnRewriteError(f"{path}: not a JSON object")
    return config


def _decoder(config: dict, path: Path) -> dict:
    """The ``model.decoder`` section of ``config`` (read from ``path``), or one line saying it has none."""
    decoder = config.get("model", {}).get("decoder") if isinstance(config.get("model"), dict) else None
    if not isinstance(decoder, dict):
        raise AttnRewriteError(f"{path}: has no model.decoder section")
    return decoder
