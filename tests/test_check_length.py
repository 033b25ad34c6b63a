"""The fidelity check exercises the replacement (issue 29): by default it runs past every replaced
site's exact part (a window's 3W + sinks, linformer's k, an lsh chunk), capped by the model's own
position limit; given a length at which sites stay exact, it says so, and a gate then fails
unless --allow-exact, since it proved nothing about them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from attnrewrite.cli import main
from attnrewrite.passes import linear, linformer, lsh
from attnrewrite.passes.window.settings import Window
from attnrewrite.passes.window.torch_form import windowed_kernel_attention
from attnrewrite.site import AttentionSite, MaskKind

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"  # 512 positions

# method's flags -> (the default length, why it, the exact part's words); the sample has 2 sites
METHODS = {
    "hedgehog": (["-O", "window=32"], 320, "seq 320: past window=32's reach (97) for every site", "window=32"),
    "linformer": (
        [],
        512,
        "seq 512: as long as the model takes, past proj_dim=256's reach (256) for every site",
        "proj_dim=256",
    ),
    "lsh": ([], 384, "seq 384: past chunk=64's reach (128) for every site", "chunk=64"),
}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _edited_sample(path: Path, edit) -> Path:
    model = onnx.load(SAMPLE)
    edit(model, {i.name: i for i in model.graph.initializer})
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def trained_like(tmp_path_factory) -> Path:
    """The sample with the peaked attention of a trained model and attention outputs that matter
    beside the residual (its random weights attend almost uniformly, so every method is within
    1e-5 of it there)."""

    def sharpen(model, initializers):
        scales = {"/self/query/": 12, "/self/key/": 12, "/self/value/": 8, "/attention/output/dense/": 8}
        for node in model.graph.node:
            scale = next((s for part, s in scales.items() if part in node.name), None)
            if node.op_type == "MatMul" and scale is not None:
                weight = initializers[node.input[1]]
                weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * scale, weight.name))

    return _edited_sample(tmp_path_factory.mktemp("trained") / "sharp.onnx", sharpen)


def _with_positions(path: Path, positions: int) -> Path:
    """The sample cut to ``positions`` positions: its position table and position ids."""

    def cut(model, initializers):
        table = initializers["model.embeddings.position_embeddings.weight"]
        table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table)[:positions], table.name))
        ids = next(n for n in model.graph.node if n.op_type == "Constant" and "Slice" in n.output[0])
        ids.attribute[0].t.CopyFrom(numpy_helper.from_array(np.arange(positions, dtype=np.int64)[None]))

    return _edited_sample(path, cut)


@pytest.mark.parametrize("method", METHODS)
def test_the_default_length_exercises_every_replaced_site(tmp_path, capsys, trained_like, method):
    options, seq, why, _ = METHODS[method]
    output, report = tmp_path / "o.onnx", tmp_path / "r.json"
    argv = [trained_like, "--to", method, *options, "-o", output, "--check", "--min-cosine", "0.1"]
    code, out, err = run(capsys, *argv, "--report", report)
    assert (code, err) == (0, "")
    assert f"inputs: generated (batch 2, seq {seq}, seed 0); {why}\n" in out
    assert "note:" not in out
    check = json.loads(report.read_text())["check"]
    assert check["inputs"] == {"input_ids": [2, seq], "attention_mask": [2, seq]}
    assert check["exact_sites"] == []
    assert check["observed"]["cosine_min"] < 0.99  # approximated, as a trained model shows it

    # `check` reads the method and options from the rewritten model's record: the same length
    code, out, _ = run(capsys, "check", trained_like, output)
    assert code == 0 and f"seq {seq}, seed 0); {why}\n" in out


@pytest.mark.parametrize("method", METHODS)
def test_a_short_seq_says_the_sites_are_exact_and_fails_the_gate(tmp_path, capsys, trained_like, method):
    options, _, _, said = METHODS[method]
    output = tmp_path / "o.onnx"
    argv = [trained_like, "--to", method, *options, "-o", output, "--check", "--min-cosine", "0.99", "--seq", "32"]
    note = f"at seq 32 the 2 {method} {said} sites are exact: this check does not measure them"
    code, out, err = run(capsys, *argv)
    assert code == 1 and not output.exists()
    assert f"inputs: generated (batch 2, seq 32, seed 0)\nnote: {note}\n" in out
    assert err == (
        f"attnrewrite: error: fidelity gate failed: {note}; check longer inputs (--seq), "
        "or accept it with --allow-exact; nothing written\n"
    )

    code, out, err = run(capsys, *argv, "--allow-exact")
    assert (code, err) == (0, "") and output.exists()
    assert f"note: {note}\n" in out and " 1.000000  1.000000  1.000000\n" in out  # the original itself


def test_check_records_the_exact_sites_in_its_json_and_report(tmp_path, capsys):
    rewritten, as_json, report = tmp_path / "o.onnx", tmp_path / "c.json", tmp_path / "r.json"
    assert run(capsys, SAMPLE, "--to", "hedgehog", "-O", "window=32", "-o", rewritten)[0] == 0
    argv = ["check", SAMPLE, rewritten, "--seq", "64", "--min-cosine", "0.5", "--json", as_json, "--report", report]
    code, _, err = run(capsys, *argv)
    note = "at seq 64 the 2 hedgehog window=32 sites are exact: this check does not measure them"
    assert (code, err) == (
        1,
        f"attnrewrite: error: fidelity gate failed: {note}; check longer inputs (--seq), "
        "or accept it with --allow-exact\n",
    )
    exact = {
        "method": "hedgehog",
        "said": "window=32",
        "sites": 2,
        "exact_up_to": 64,
        "seq": 64,
        "positions": None,
        "everywhere": False,
        "note": note,
    }
    written = json.loads(report.read_text())
    assert written["outcome"] == "gate_failed" and written["check"]["exact_sites"] == [exact]
    assert written["check"]["thresholds"] == {"min_cosine": 0.5, "min_agreement": None, "allow_exact": False}

    assert run(capsys, *argv, "--allow-exact")[0] == 0
    assert json.loads(as_json.read_text())["exact_sites"] == [exact]
    assert json.loads(report.read_text())["check"]["thresholds"]["allow_exact"] is True


def test_a_model_whose_positions_are_within_the_exact_part_passes(tmp_path, capsys):
    """128 positions and window=64: the rewrite is the original on every input the model takes."""
    model, output = _with_positions(tmp_path / "short.onnx", 128), tmp_path / "o.onnx"
    argv = [model, "--to", "hedgehog", "-O", "window=64", "-o", output, "--check", "--min-cosine", "0.999"]
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "") and output.exists()
    assert "seq 128, seed 0); seq 128: as long as the model takes, within window=64's exact length (128)\n" in out
    assert (
        "note: the 2 hedgehog window=64 sites are exact up to 128 positions and the model takes at most 128: "
        "the rewrite is exact on every input the model accepts\n"
    ) in out


def test_layer_selection_measures_costs_past_the_exact_part(tmp_path, capsys):
    argv = [SAMPLE, "--to", "hedgehog", "-O", "window=32", "--layers", "auto", "--min-cosine", "0.5"]
    code, out, _ = run(capsys, *argv, "-o", tmp_path / "o.onnx")
    assert code == 0
    assert "inputs: generated (batch 2, seq 320, seed 0); seq 320: past window=32's reach (97) for every site): " in out

    short = tmp_path / "short.onnx"
    code, out, err = run(capsys, *argv, "-o", short, "--seq", "16")  # every trial exact: cost 1.0, proving nothing
    assert code == 1 and not short.exists()
    assert "the 2 hedgehog window=32 sites are exact: this check does not measure them" in err


# --- each method's exact part, against its torch module ---------------------------------------------


def _softmax_attention(q, k, v, scale: float, causal: bool):
    logits = scale * q @ k.transpose(-2, -1)
    if causal:
        logits = logits.masked_fill(torch.ones(q.shape[-2], k.shape[-2]).triu(1).bool(), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def _is_exact(attend, n: int, causal: bool) -> bool:
    q, k, v = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n + i)) for i in range(3))
    return torch.allclose(attend(q, k, v), _softmax_attention(q, k, v, 0.5, causal), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,window_next,sinks", [(4, True, 1), (4, False, 0), (3, True, 7), (5, False, 6)])
def test_a_window_is_exact_up_to_its_exact_part_and_not_one_position_more(window, window_next, sinks, causal):
    settings = Window(window, window_next, sinks)
    part = settings.exact_part(causal)

    def attend(q, k, v):
        phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        return windowed_kernel_attention(phi_q, phi_k, q, k, v, settings, scale=0.5, causal=causal)

    assert all(_is_exact(attend, n, causal) for n in range(1, part.exact_up_to + 1))
    assert not _is_exact(attend, part.exact_up_to + 1, causal)
    assert part.reach == (2 if causal else 3 if window_next else 2) * window + sinks


@pytest.mark.parametrize(
    "method,options,causal",
    [
        (lsh, lsh.Options(chunk=8), False),
        (lsh, lsh.Options(chunk=8, n_buckets=2, n_hashes=1), True),
        (linformer, linformer.Options(proj_dim=8, max_len=32), False),
        (linformer, linformer.Options(proj_dim=8, max_len=32, projection="pool"), False),
    ],
)
def test_lsh_and_linformer_are_exact_up_to_their_exact_part(method, options, causal):
    mask = MaskKind.CAUSAL if causal else MaskKind.NONE
    site = AttentionSite("s", scale=0.5, mask=mask, rank=4, num_heads=2, head_dim=8, value_dim=8)
    module, part = method.torch_module(site, options), method.exact_part(options, causal)
    assert _is_exact(module, part.exact_up_to, causal) and not _is_exact(module, part.exact_up_to + 1, causal)


def test_methods_without_an_exact_part_say_so():
    assert linformer.exact_part(linformer.Options(exact_if_short=False), False) is None
    assert linear.exact_part(linear.Options(window=0), False) is None
