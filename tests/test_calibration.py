"""Calibration (attnrewrite/passes/fit.py and both frontends): fitting learnable replacements to the exact
softmax attention they replace, the learnable lowerings' ONNX-vs-torch parity, and the errors."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import models
import numpy as np
import onnx
import pytest
import torch
from attention_graphs import AttentionSpec, build_attention_model, lowering_session, make_feeds
from conftest import read_record
from models import SAMPLE_BERT, relative_error, run_onnx, text_args
from onnx import numpy_helper

import attnrewrite
import attnrewrite.onnx.calibrate
import attnrewrite.onnx.io
from attnrewrite import calibration, passes
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError
from attnrewrite.passes import fit
from attnrewrite.site import AttentionSite, MaskKind

HEADS, HEAD_DIM = 2, 16


def clustered_site_samples(seed: int = 0, batches: int = 3, batch: int = 4, n: int = 64, clusters: int = 4):
    """A peaked, trained-like site: each token belongs to one of a few clusters per head; q and
    k sit near their cluster's centre (norm 8, so softmax attends almost only inside the
    cluster) and v near the cluster's value, as a trained head that groups tokens does."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(HEADS, clusters, HEAD_DIM, generator=g), dim=-1) * 8
    values = torch.randn(HEADS, clusters, HEAD_DIM, generator=g)
    samples = fit.SiteSamples()
    for _ in range(batches):
        cluster = torch.randint(clusters, (batch, HEADS, n), generator=g)

        def near(table):
            chosen = torch.stack([table[h][cluster[:, h]] for h in range(HEADS)], 1)
            return chosen + 0.3 * torch.randn(chosen.shape, generator=g)

        samples.add(near(centres), near(centres), near(values), None)
    return samples


def site(mask=MaskKind.NONE, heads=HEADS) -> AttentionSite:
    return AttentionSite(
        "attn",
        scale=HEAD_DIM**-0.5,
        mask=mask,
        rank=4 if heads else 3,
        num_heads=heads,
        head_dim=HEAD_DIM,
        value_dim=HEAD_DIM,
    )


def test_calibration_cuts_the_attention_error_tenfold_and_is_seeded():
    samples = clustered_site_samples()
    s = site()
    results, states = [], []
    for _ in range(2):
        module = passes.linear.torch_module(s, passes.linear.Options(), learnable=True)
        results.append(fit.fit_site(module, samples, scale=s.scale, causal=False, steps=200, lr=1e-2, seed=0))
        states.append(module.state_dict())
    first = results[0]
    assert first.loss_before / first.loss_after >= 10, first
    assert first.steps == 200 and first.examples == 12 and first.query_rows == 12 * HEADS * 64
    assert results[1].loss_after == first.loss_after
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    # the loss before is the uncalibrated module's: identity maps change nothing
    plain = passes.linear.torch_module(s, passes.linear.Options())
    q, k, v, _ = samples.batch(0)
    with torch.no_grad():
        expected = ((plain(q, k, v) - fit.exact_attention(q, k, v, s.scale)) ** 2).mean()
    fresh = passes.linear.torch_module(s, passes.linear.Options(), learnable=True)
    with torch.no_grad():
        assert torch.equal(fresh(q, k, v), plain(q, k, v))
    assert expected > first.loss_after * 10


# --- learnable lowerings: the ONNX function reads the fitted values -------------------------

LEARNABLE = [
    ("linear", {}, MaskKind.NONE, HEADS),
    ("linear", {}, MaskKind.KEY_PADDING, None),
    ("linear", {"chunk": 8}, MaskKind.CAUSAL, HEADS),
    ("linear", {"chunk": 8}, MaskKind.CAUSAL_KEY_PADDING, HEADS),
    ("linear", {"window": 4}, MaskKind.KEY_PADDING, HEADS),
    ("linear", {"window": 4}, MaskKind.CAUSAL, None),
    ("hydra", {}, MaskKind.NONE, HEADS),
    ("hydra", {}, MaskKind.KEY_PADDING, HEADS),
    ("hydra", {}, MaskKind.CAUSAL, None),
    ("favor", {"features": 24}, MaskKind.NONE, HEADS),
    ("favor", {"features": 24}, MaskKind.KEY_PADDING, HEADS),
    ("favor", {"features": 24, "chunk": 8}, MaskKind.CAUSAL, HEADS),
    ("favor", {"features": 24, "chunk": 8, "variant": "hyperbolic"}, MaskKind.CAUSAL_KEY_PADDING, None),
    ("linformer", {"proj_dim": 8, "max_len": 32}, MaskKind.NONE, HEADS),
    ("linformer", {"proj_dim": 8, "max_len": 32, "projection": "learned"}, MaskKind.KEY_PADDING, HEADS),
    ("linformer", {"proj_dim": 8, "max_len": 32, "share_kv": True}, MaskKind.KEY_PADDING, None),
]


def perturbed_state(module, seed: int = 1) -> dict[str, np.ndarray]:
    """The module's parameters moved well away from their start (as a fit would move them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g) * param.abs().mean())
    return {name: value.numpy() for name, value in module.state_dict().items()}


def attention_inputs(heads, mask: MaskKind, batch: int = 2, n: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lead = (batch, heads) if heads else (batch * HEADS,)
    q, k, v = (torch.randn(*lead, n, HEAD_DIM, generator=g) for _ in range(3))
    keep = torch.ones(*lead, n, 1)
    if mask.key_padding:
        keep[-1, ..., n - 5 :, :] = 0.0
    return q, k, v, keep


@pytest.mark.parametrize("method, options, mask, heads", LEARNABLE)
def test_learnable_lowering_with_fitted_values_equals_the_torch_module(method, options, mask, heads):
    method_pass = passes.get_pass(method)
    s = site(mask, heads)
    opts = passes.make_options(method_pass, **options)
    module = method_pass.torch_module(s, opts, learnable=True)
    weights = perturbed_state(module)
    lowering = method_pass.onnx_lowering(s, opts, 20, weights=weights)
    for name, value in weights.items():  # state_dict names are the constants' names
        if name in lowering.constants:
            np.testing.assert_array_equal(lowering.constants[name], value)
    assert set(lowering.constants) >= set(weights) - {"F"}  # share_kv: F is E
    q, k, v, keep = attention_inputs(heads, mask)
    with torch.no_grad():
        expected = module(q, k, v, keep if mask.key_padding else None).numpy()
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "key_keep": keep.numpy()}
    actual = lowering_session(lowering, q.dim()).run(None, feeds)[0]
    assert relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("method, op_type", [("linear", "LinearAttention"), ("hydra", "Hydra")])
def test_query_key_maps_exist_only_when_learnable(method, op_type):
    method_pass = passes.get_pass(method)
    opts = passes.make_options(method_pass)
    assert not list(method_pass.torch_module(site(), opts).parameters())
    learnable = method_pass.torch_module(site(), opts, learnable=True)
    assert {n: tuple(p.shape) for n, p in learnable.named_parameters()} == {
        "query_map": (HEADS, HEAD_DIM, HEAD_DIM),
        "key_map": (HEADS, HEAD_DIM, HEAD_DIM),
    }
    folded = method_pass.torch_module(site(heads=None), opts, learnable=True)
    assert folded.query_map.shape == (1, HEAD_DIM, HEAD_DIM)
    plain = method_pass.onnx_lowering(site(), opts, 18)
    assert plain.op_type == op_type
    assert "query_map" not in plain.constants
    fitted = method_pass.onnx_lowering(site(), opts, 18, weights=perturbed_state(learnable))
    assert fitted.op_type == f"Learned{op_type}"


def test_lsh_and_unfittable_linformer_say_why():
    assert "lsh has nothing to fit" in passes.lsh.nothing_to_fit(passes.lsh.Options())
    with pytest.raises(ValueError, match="nothing to fit"):
        passes.lsh.torch_module(site(), passes.lsh.Options(), learnable=True)
    pool = passes.linformer.Options(projection="pool")
    assert "'pool' projection has nothing to fit" in passes.linformer.nothing_to_fit(pool)
    for method in ("linear", "hydra", "favor", "linformer", "hedgehog"):
        assert passes.nothing_to_fit(passes.get_pass(method), passes.make_options(passes.get_pass(method))) is None


# --- both frontends ---------------------------------------------------------------------------


def _rewrite_onnx_with_torch_weights(
    model: onnx.ModelProto, method: str, feeds, fitted: dict, **options
) -> onnx.ModelProto:
    """The ONNX rewrite with learnable lowerings (0 calibration steps: initial values), its
    fittable initializers then overwritten with ``fitted`` (layer -> a torch module's state)."""
    rewritten = attnrewrite.rewrite(model, to=method, calibrate=feeds, calibrate_steps=0, **options)
    sites = {s["name"]: s["layer"] for s in read_record(rewritten)["sites"]}
    written = 0
    for tensor in rewritten.graph.initializer:
        site_name, _, constant = tensor.name.rpartition("/")
        if site_name in sites and constant in fitted[sites[site_name]]:
            tensor.CopyFrom(numpy_helper.from_array(fitted[sites[site_name]][constant], tensor.name))
            written += 1
    assert written == sum(len(state) for state in fitted.values())
    return rewritten


@pytest.mark.parametrize("method, options", [("linear", {}), ("favor", {}), ("hedgehog", {"window": 4})])
def test_torch_calibration_written_into_the_onnx_rewrite_gives_the_same_model(exports, method, options):
    export = exports.get("bert-eager", "legacy")
    args = text_args(12)
    calibration_inputs = [text_args(12, seed=s) for s in range(3)]
    gm = attnrewrite.rewrite(
        torch.export.export(export.module, args), to=method, calibrate=calibration_inputs, calibrate_steps=20, **options
    )
    record = gm.meta["attnrewrite"]
    fitted = {}
    for entry in record["sites"]:
        calibration = entry["calibration"]
        assert calibration["loss_after"] < calibration["loss_before"]
        assert calibration["steps"] == 20 and calibration["examples"] == 3
        module = gm.get_submodule(entry["replacement"].split(" at ")[1])
        assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in module.parameters())
        fitted[entry["layer"]] = {n: t.detach().numpy() for n, t in module.state_dict().items()}
    feeds = dict(zip(export.spec.input_names, (a.numpy() for a in calibration_inputs[0])))
    onnx_model = _rewrite_onnx_with_torch_weights(export.load(), method, feeds, fitted, **options)
    with torch.no_grad():
        expected = gm(*args).numpy()
    assert relative_error(run_onnx(onnx_model, dict(zip(export.spec.input_names, args))), expected) < 1e-5


def test_a_fit_that_ends_worse_than_it_started_keeps_its_starting_values():
    samples = clustered_site_samples()
    s = site()
    module = passes.favor.torch_module(s, passes.favor.Options(), learnable=True)
    start = {name: value.clone() for name, value in module.state_dict().items()}
    result = fit.fit_site(module, samples, scale=s.scale, causal=False, steps=20, lr=10.0)  # a rate that diverges
    assert result.rejected_loss > 10 * result.loss_before
    assert result.loss_after == result.loss_before
    assert all(torch.equal(value, start[name]) for name, value in module.state_dict().items())
    kept = passes.favor.torch_module(s, passes.favor.Options(), learnable=True)
    assert fit.fit_site(kept, samples, scale=s.scale, causal=False, steps=20, lr=1e-2).rejected_loss is None


def test_an_end_to_end_fit_that_ends_worse_keeps_its_starting_values():
    start = torch.tensor([1.001])
    weight = torch.nn.Parameter(start.clone())
    batches = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    result = fit.fit_end_to_end(lambda x: [weight * x], [weight], batches, [[x] for x in batches], steps=3, lr=10.0)
    assert result.rejected_loss > 100 * result.loss_before
    assert result.loss_after == result.loss_before == pytest.approx(1e-6, rel=1e-3)
    assert torch.equal(weight.detach(), start)


def test_the_end_to_end_loss_is_measured_on_batches_spread_over_the_data():
    """Before and after fitting, each measured batch is one run of the whole model: eight of
    them, first and last included, not all 20; the steps still draw from every batch."""
    weight = torch.nn.Parameter(torch.tensor([1.5]))
    batches = [torch.tensor([float(i + 1)]) for i in range(20)]
    measured, fitted = [], set()

    def run(x):
        (fitted.add if torch.is_grad_enabled() else measured.append)(int(x))
        return [weight * x]

    result = fit.fit_end_to_end(run, [weight], batches, [[x] for x in batches], steps=200, lr=1e-2)
    assert measured == [1, 4, 6, 9, 12, 15, 17, 20] * 2
    assert fitted == set(range(1, 21))
    assert (result.measured_batches, result.batches) == (8, 20)
    assert result.loss_after < result.loss_before / 10


def test_a_site_s_loss_is_measured_on_batches_spread_over_its_samples():
    """Before and after fitting, the loss is measured on eight of 20 batches, first and last
    included, and is their output MSE; the steps still draw from every batch. Batch i has
    i + 8 positions, so a forward pass says which batch it ran."""
    s = site()
    g = torch.Generator().manual_seed(0)
    samples = fit.SiteSamples()
    for i in range(20):
        samples.add(*(torch.randn(2, HEADS, i + 8, HEAD_DIM, generator=g) for _ in range(3)), None)
    measured, fitted = [], set()

    class Recording(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = passes.linear.torch_module(s, passes.linear.Options(), learnable=True)

        def forward(self, q, k, v, key_keep=None):
            (fitted.add if torch.is_grad_enabled() else measured.append)(q.shape[-2] - 8)
            return self.inner(q, k, v, key_keep)

    module, spread = Recording(), [0, 3, 5, 8, 11, 14, 16, 19]
    unfitted = [module.inner(*samples.batch(i)[:3]).detach() for i in spread]
    result = fit.fit_site(module, samples, scale=s.scale, causal=False, steps=100, lr=1e-2)
    assert measured == spread * 2
    assert fitted == set(range(20))
    assert (result.measured_batches, result.batches) == (8, 20)
    exact = [fit.exact_attention(*samples.batch(i)[:3], s.scale) for i in spread]
    squared = sum(float((u - e).square().sum()) for u, e in zip(unfitted, exact))
    assert result.loss_before == pytest.approx(squared / sum(e.numel() for e in exact), rel=1e-5)


# --- the command line -------------------------------------------------------------------------


def calibration_npz(path, examples: int = 12, n: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids for samples/tiny_bert.onnx (vocabulary 1000), every third example padded."""
    rng = np.random.default_rng(seed)
    arrays = {"input_ids": rng.integers(0, 1000, (examples, n)), "attention_mask": np.ones((examples, n), np.int64)}
    arrays["attention_mask"][::3, n - 3 :] = 0
    np.savez(path, **arrays)
    return arrays


def test_cli_calibrates_each_site_and_writes_the_fitted_initializers(tmp_path, capsys):
    arrays = calibration_npz(tmp_path / "data.npz")
    out = tmp_path / "out.onnx"
    argv = [str(SAMPLE_BERT), "--to", "favor", "--calibrate", str(tmp_path / "data.npz"), "--calibrate-steps", "30"]
    assert main([*argv, "-o", str(out)]) == 0
    progress = capsys.readouterr().err.splitlines()
    assert len(progress) == 2
    assert re.fullmatch(
        r"calibrating site 1/2 \(layer 0\): loss \S+ -> \S+ \(on 2 of 2 batches; steps 30, [\d.]+ s\)", progress[0]
    )
    model = onnx.load(out)
    record = read_record(model)
    digest = hashlib.sha256()
    for name in ("input_ids", "attention_mask"):  # the model's input order, batch by batch
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    initial = passes.favor.projection_for(AttentionSite("s", head_dim=model_head_dim(record)), passes.favor.Options())
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for entry in record["sites"]:
        calibration = entry["calibration"]
        assert calibration["loss_after"] < calibration["loss_before"]
        assert calibration["steps"] == 30 and calibration["examples"] == 12
        assert calibration["tokens"] == int(arrays["attention_mask"].sum())
        assert len(calibration["data_sha256"]) == 64
        fitted = weights[f"{entry['name']}/projection"]
        assert fitted.shape == initial.shape and np.abs(fitted - initial).max() > 1e-4
    # both sites start from the same draw, which an uncalibrated rewrite stores once: fitted, each owns its own
    first, second = (weights[f"{entry['name']}/projection"] for entry in record["sites"])
    assert not np.array_equal(first, second)
    # the API on the same data fits the same values, and the output passes the gates as written
    again = attnrewrite.rewrite(str(SAMPLE_BERT), to="favor", calibrate=str(tmp_path / "data.npz"), calibrate_steps=30)
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in again.graph.initializer} == {
        name: array.tobytes() for name, array in weights.items()
    }
    assert len({entry["calibration"]["data_sha256"] for entry in record["sites"]}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here, so the fits run on the CPU")
def test_onnx_calibration_fits_on_cuda_when_torch_sees_a_gpu(tmp_path, monkeypatch):
    arrays = calibration_npz(tmp_path / "data.npz")

    def fitted_projections(device: str) -> dict[str, np.ndarray]:
        monkeypatch.setattr(attnrewrite.onnx.calibrate, "_fitting_device", lambda: torch.device(device))
        model = attnrewrite.rewrite(
            str(SAMPLE_BERT), to="favor", calibrate=arrays, calibrate_steps=5, calibrate_lr=1e-3
        )
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("/projection")}

    torch.cuda.reset_peak_memory_stats()
    on_cuda = fitted_projections("cuda")
    assert torch.cuda.max_memory_allocated() > 0
    on_cpu = fitted_projections("cpu")
    assert on_cuda.keys() == on_cpu.keys() and len(on_cpu) == 2
    for name, values in on_cpu.items():
        np.testing.assert_allclose(on_cuda[name], values, atol=1e-4)


def test_cli_keeps_the_starting_values_of_a_fit_that_ends_worse(tmp_path, capsys):
    calibration_npz(tmp_path / "data.npz")
    out = tmp_path / "out.onnx"
    argv = [str(SAMPLE_BERT), "--to", "favor", "--calibrate", str(tmp_path / "data.npz"), "--calibrate-steps", "30"]
    assert main([*argv, "--calibrate-lr", "10", "-o", str(out)]) == 0
    progress = capsys.readouterr().err.splitlines()
    assert len(progress) == 2
    for line in progress:
        assert re.fullmatch(
            r"calibrating site \d/2 \(layer \d\): loss \S+ -> \S+, worse: the values before fitting kept "
            r"\(on 2 of 2 batches; steps 30, [\d.]+ s\)",
            line,
        ), line
    model = onnx.load(out)
    record = read_record(model)
    initial = passes.favor.projection_for(AttentionSite("s", head_dim=model_head_dim(record)), passes.favor.Options())
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for entry in record["sites"]:
        calibration = entry["calibration"]
        assert calibration["kept_unfitted"] is True
        assert calibration["rejected_loss"] > calibration["loss_before"] == calibration["loss_after"]
        np.testing.assert_array_equal(weights[f"{entry['name']}/projection"], initial)


def test_onnx_calibration_is_sequential(tmp_path):
    """Site 2 is fitted on what the model with site 1 fitted gives it: its recorded loss before
    fitting is the unfitted module's on the inputs the written model feeds its replacement, not
    on those the model with site 1 unfitted would feed it."""
    arrays = calibration_npz(tmp_path / "data.npz", examples=8)
    original = peaked_bert(tmp_path / "peaked.onnx")
    model = attnrewrite.rewrite(original, to="hedgehog", calibrate=str(tmp_path / "data.npz"), calibrate_steps=30)
    entries = read_record(model)["sites"]
    second = sites_of(entries)[1]

    def loss_before_on_inputs_of(rewritten) -> float:
        samples = fit.SiteSamples()
        samples.add(*replacement_inputs(rewritten, 1, arrays))
        fresh = passes.hedgehog.torch_module(second, passes.hedgehog.Options(), learnable=True)
        return fit.fit_site(fresh, samples, scale=second.scale, causal=False, steps=0).loss_before

    recorded = entries[1]["calibration"]["loss_before"]
    assert loss_before_on_inputs_of(model) == pytest.approx(recorded, rel=1e-5)
    assert loss_before_on_inputs_of(attnrewrite.rewrite(original, to="hedgehog")) != pytest.approx(recorded, rel=1e-2)


def test_each_collecting_run_computes_only_what_lies_after_the_previous_site():
    """Site 1's run is given what site 0's run computed before site 0's replacement (its q and
    the shared hidden state), as extra inputs that site 0's run gives as outputs, and computes
    only the rest; a value of unknown type cannot be handed over and is computed again."""
    node = onnx.helper.make_node
    graph = onnx.helper.make_graph(
        [
            node("Relu", ["x"], ["hidden"], name="embed"),
            node("Neg", ["hidden"], ["q0"], name="project0"),
            node("Abs", ["q0"], ["attention0"], name="replacement0"),
            node("Add", ["attention0", "hidden"], ["residual"], name="residual0"),
            node("Neg", ["residual"], ["q1"], name="project1"),
        ],
        "chain",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [],
    )
    model = onnx.helper.make_model(graph)
    calibrate = attnrewrite.onnx.calibrate
    typed = {"hidden", "q0", "attention0", "residual", "q1"}
    first, second = calibrate._plan_cuts(model, [["q0"], ["q1"]], typed)
    assert [n.name for n in first.nodes] == ["embed", "project0"] and first.given == []
    assert first.carry == ["hidden", "q0"]
    assert [n.name for n in second.nodes] == ["replacement0", "residual0", "project1"]
    assert second.given == ["hidden", "q0"] and second.carry == []
    part = calibrate._cut_model(model, second, ["q1"], {"hidden": 1, "q0": 1, "q1": 1})
    assert [i.name for i in part.graph.input] == ["x", "hidden", "q0"]
    assert [o.name for o in part.graph.output] == ["q1"]

    first, second = calibrate._plan_cuts(model, [["q0"], ["q1"]], typed - {"hidden"})
    assert first.carry == second.given == ["q0"]
    assert [n.name for n in second.nodes] == ["embed", "replacement0", "residual0", "project1"]


@pytest.mark.parametrize("name, exporter", [("bert-eager", "legacy"), ("bert-sdpa", "dynamo"), ("gpt2", "dynamo")])
def test_every_site_is_collected_on_what_the_written_model_feeds_it(exports, name, exporter):
    """Each site's run starts from what the previous site's run handed over (_Runs): on real
    exports of both exporters, every site's recorded loss before fitting is the unfitted
    module's on the inputs the written model feeds that replacement (no later fit changes them)."""
    export = exports.get(name, exporter)
    feeds = {name: x.numpy() for name, x in export.parity_inputs().items()}
    options = passes.hedgehog.Options(window=4)
    model = attnrewrite.rewrite(export.load(), to="hedgehog", window=4, calibrate=[feeds], calibrate_steps=2)
    entries = read_record(model)["sites"]
    assert len(entries) >= 2
    for index, (site, entry) in enumerate(zip(sites_of(entries), entries)):
        samples = fit.SiteSamples()
        samples.add(*replacement_inputs(model, index, feeds))
        fresh = passes.hedgehog.torch_module(site, options, learnable=True)
        again = fit.fit_site(fresh, samples, scale=site.scale, causal=site.mask.causal, steps=0).loss_before
        assert again == pytest.approx(entry["calibration"]["loss_before"], rel=1e-4), index


def peaked_bert(path) -> str:
    """samples/tiny_bert.onnx with every square projection 8x larger: random-init attention is
    nearly uniform, which a kernel gets right unfitted; these logits (64x) are peaked."""
    model = onnx.load(SAMPLE_BERT)
    for tensor in model.graph.initializer:
        if len(tensor.dims) == 2 and tensor.dims[0] == tensor.dims[1]:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * 8, tensor.name))
    onnx.save(model, path)
    return str(path)


def replacement_inputs(model: onnx.ModelProto, index: int, feeds: dict) -> list[np.ndarray]:
    """q, k, v and key_keep (float32) of the index-th replacement, run on ``feeds``."""
    import onnxruntime as ort

    call = [n for n in model.graph.node if n.domain == passes.lowering.DOMAIN][index]
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in call.input[:4])
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    *qkv, keep = session.run(list(call.input[:4]), feeds)
    return [*qkv, keep.astype(np.float32)]


def model_head_dim(record) -> int:
    return record["sites"][0]["head_dim"]


def test_data_fingerprint_is_of_the_arrays_only(tmp_path):
    graph = attnrewrite.onnx.io.load_model(SAMPLE_BERT).graph
    arrays = calibration_npz(tmp_path / "data.npz")
    from_file = calibration.onnx_calibration(str(tmp_path / "data.npz"), graph)
    from_dict = calibration.onnx_calibration(arrays, graph)
    assert from_file.fingerprint == from_dict.fingerprint
    assert [b["input_ids"].shape for b in from_file.batches] == [(8, 10), (4, 10)]
    arrays["input_ids"][0, 0] += 1
    assert calibration.onnx_calibration(arrays, graph).fingerprint != from_file.fingerprint


def test_a_batch_is_cut_along_its_examples_only_where_every_input_has_them():
    ids, mask = np.arange(30).reshape(10, 3), np.ones((10, 3), np.int64)
    parts = calibration.split_batch({"input_ids": ids, "attention_mask": mask}, 4)
    assert [p["input_ids"].tolist() for p in parts] == [ids[:4].tolist(), ids[4:8].tolist(), ids[8:].tolist()]
    assert all(p["attention_mask"].shape == p["input_ids"].shape for p in parts)
    # an input shared by every example (leading 1, or no axes) cannot be cut: the batch stays whole
    for shared in (np.arange(3).reshape(1, 3), np.array(2.0)):
        parts = calibration.split_batch({"input_ids": ids, "position_ids": shared}, 4)
        assert [(p["input_ids"].shape, p["position_ids"].shape) for p in parts] == [((10, 3), shared.shape)]


@pytest.mark.parametrize(
    "make_data, extra, message",
    [
        (
            lambda p: np.savez(p / "d.npz", ids=np.zeros((2, 4), np.int64)),
            [],
            "{d}/d.npz: 'ids' is not an input of the model (inputs: input_ids, attention_mask)",
        ),
        (
            lambda p: (p / "d.npz").write_text("a text\nanother text\n"),
            [],
            "{d}/d.npz: a text file needs --tokenizer tokenizer.json to make the model's inputs",
        ),
        (
            lambda p: calibration_npz(p / "d.npz"),
            ["--to", "lsh"],
            "cannot calibrate: lsh has nothing to fit (its buckets come from random rotations and a sort)",
        ),
        (
            lambda p: calibration_npz(p / "d.npz"),
            ["-O", "projection=pool", "--to", "linformer"],
            "cannot calibrate: linformer's 'pool' projection has nothing to fit (use gaussian or learned)",
        ),
        (
            lambda p: calibration_npz(p / "d.npz"),
            ["--to", "hydra", "--calibrate-ce", "1"],
            "cannot calibrate with the attention-weight cross-entropy: hydra gives no attention weights",
        ),
        (
            lambda p: calibration_npz(p / "d.npz"),
            ["-O", "window=4", "--calibrate-ce", "0.5"],
            "cannot calibrate with the attention-weight cross-entropy: favor with a window gives no attention weights",
        ),
    ],
)
def test_calibration_errors_are_one_line_and_write_nothing(tmp_path, capsys, make_data, extra, message):
    make_data(tmp_path)
    out = tmp_path / "out.onnx"
    argv = [str(SAMPLE_BERT), "--to", "favor", *extra, "--calibrate", str(tmp_path / "d.npz"), "-o", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"attnrewrite: error: {message.format(d=tmp_path)}\n"
    assert not out.exists()


def test_without_torch_calibration_is_one_line(tmp_path, capsys, monkeypatch):
    calibration_npz(tmp_path / "d.npz")
    monkeypatch.setattr(passes.optional_torch, "torch", None)
    out = tmp_path / "out.onnx"
    assert main([str(SAMPLE_BERT), "--to", "favor", "--calibrate", str(tmp_path / "d.npz"), "-o", str(out)]) == 2
    assert (
        capsys.readouterr().err == "attnrewrite: error: calibration fits in PyTorch: pip install 'attnrewrite[torch]'\n"
    )
    assert not out.exists()


def word_tokenizer(path, direction: str = "right") -> None:
    """A tokenizer.json: whitespace words -> ids 3.. (1000-word vocabulary), [PAD] = 0, padding
    as the file says (``direction``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 3 for i in range(997)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_padding(direction=direction, pad_id=0, pad_token="[PAD]")
    tokenizer.save(str(path))


def test_text_calibration_tokenizes_by_input_name_pads_per_batch_and_truncates(tmp_path, capsys):
    word_tokenizer(tmp_path / "tokenizer.json", direction="left")
    texts = [" ".join(f"w{(7 * i + j) % 997}" for j in range(2 + i % 5)) for i in range(10)] + ["w1 " * 40]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n\n")
    graph = attnrewrite.onnx.io.load_model(SAMPLE_BERT).graph
    data = calibration.onnx_calibration(
        str(tmp_path / "texts.txt"), graph, tokenizer=tmp_path / "tokenizer.json", max_length=16, pack=False
    )
    assert (
        capsys.readouterr().err
        == "11 texts, one per example, of <= 16 tokens (packing off); 1 text longer than 16 tokens cut\n"
    )
    assert (data.text.texts, data.text.examples, data.text.cut) == (11, 11, 1)
    # texts of 2, 2, 3, 3, 4, 4, 5, 5 words share the first batch, 6, 6 and 16 (truncated) the
    # second, each padded to its longest (in file order: 6 and 16 tokens, 96 in all, not 88)
    assert [b["input_ids"].shape for b in data.batches] == [(8, 5), (3, 16)]
    first = data.batches[0]
    assert first["input_ids"][0].tolist() == [0, 0, 0, 3, 4]  # "w0 w1", padded on the left
    assert first["attention_mask"][0].tolist() == [0, 0, 0, 1, 1]
    assert first["attention_mask"].sum(1).tolist() == [2, 3, 4, 5, 2, 3, 4, 5]  # texts 0-3, 5-8 in file order
    assert data.examples == 11 and data.tokens == sum(min(len(t.split()), 16) for t in texts)
    out = tmp_path / "out.onnx"
    argv = [
        str(SAMPLE_BERT),
        "--to",
        "linear",
        "--calibrate",
        str(tmp_path / "texts.txt"),
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--max-length",
        "16",
        "--calibrate-pack",
        "off",
        "--calibrate-steps",
        "10",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    sites = read_record(onnx.load(out))["sites"]
    assert [s["calibration"]["tokens"] for s in sites] == [data.tokens] * 2
    assert sites[0]["calibration"]["text"] == {**dataclasses.asdict(data.text), "summary": data.text.summary()}


@pytest.mark.parametrize(
    "method, options",
    [
        ("linear", {}),
        ("linear", {"window": 4}),
        ("favor", {"features": 24}),
        ("favor", {"features": 24, "variant": "hyperbolic"}),
        ("hedgehog", {}),
        ("hedgehog", {"window": 4}),
    ],
)
@pytest.mark.parametrize("mask", [MaskKind.KEY_PADDING, MaskKind.CAUSAL])
def test_attention_weights_are_the_ones_the_module_applies(method, options, mask):
    method_pass = passes.get_pass(method)
    module = method_pass.torch_module(site(mask), passes.make_options(method_pass, **options), learnable=True)
    perturbed_state(module)
    q, k, v, keep = attention_inputs(HEADS, mask)
    keep = keep if mask.key_padding else None
    with torch.no_grad():
        weights = module.attention_weights(q, k, keep)
        assert relative_error((weights @ v).numpy(), module(q, k, v, keep).numpy()) < 1e-4
        assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("method", list(passes.PASSES))
def test_attention_weights_are_declared_where_the_modules_give_them(method):
    method_pass = passes.get_pass(method)
    q, k, _, keep = attention_inputs(HEADS, MaskKind.KEY_PADDING)
    for values in [{}, *([{"window": 4}] if method in passes.WINDOWED else [])]:
        options = passes.make_options(method_pass, **values)
        learnable = passes.nothing_to_fit(method_pass, options) is None
        module = method_pass.torch_module(site(MaskKind.KEY_PADDING), options, learnable=learnable)
        reason = passes.attention_weights_unavailable(method_pass, options)
        if reason is None:
            with torch.no_grad():
                assert module.attention_weights(q, k, keep).shape == (*q.shape[:-1], k.shape[-2])
        elif hasattr(module, "attention_weights"):
            with pytest.raises(ValueError, match=reason):
                module.attention_weights(q, k, keep)


def test_cross_entropy_weight_and_seed_reach_the_fit(tmp_path):
    calibration_npz(tmp_path / "data.npz")
    common = [
        str(SAMPLE_BERT),
        "--to",
        "hedgehog",
        "--calibrate",
        str(tmp_path / "data.npz"),
        "--calibrate-steps",
        "10",
    ]
    assert main([*common, "--calibrate-ce", "0.5", "--calibrate-seed", "3", "-o", str(tmp_path / "a.onnx")]) == 0
    assert main([*common, "--calibrate-ce", "0.5", "-o", str(tmp_path / "b.onnx")]) == 0
    assert main([*common, "--calibrate-seed", "3", "-o", str(tmp_path / "c.onnx")]) == 0
    seeded, other_seed, without_ce = (onnx.load(tmp_path / name) for name in ("a.onnx", "b.onnx", "c.onnx"))
    assert {(s["calibration"]["ce_weight"], s["calibration"]["seed"]) for s in read_record(seeded)["sites"]} == {
        (0.5, 3)
    }

    def fitted(model) -> dict[str, np.ndarray]:
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("/weight")}

    # another seed draws other minibatches, and the cross-entropy term changes the loss: other values
    for other in (other_seed, without_ce):
        assert fitted(other).keys() == fitted(seeded).keys()
        assert any(not np.array_equal(fitted(other)[name], value) for name, value in fitted(seeded).items())
    # the torch path takes them as keyword arguments
    encoder = models.MODELS["torch-encoder-padded"].build()
    examples = [models.MODELS["torch-encoder-padded"].inputs(2, 8)]
    gm = attnrewrite.rewrite(
        encoder, to="linear", calibrate=examples, calibrate_steps=2, calibrate_ce_weight=0.25, calibrate_seed=7
    )
    assert {(s["calibration"]["ce_weight"], s["calibration"]["seed"]) for s in gm.meta["attnrewrite"]["sites"]} == {
        (0.25, 7)
    }
    hydra_error = "^cannot calibrate with the attention-weight cross-entropy: hydra gives no attention weights$"
    with pytest.raises(AttnRewriteError, match=hydra_error):
        attnrewrite.rewrite(encoder, to="hydra", calibrate=examples, calibrate_ce_weight=1.0)


def test_cross_entropy_term_fits_too_and_is_seeded():
    samples = clustered_site_samples(batches=2)
    s = site()
    runs = []
    for _ in range(2):
        module = passes.favor.torch_module(s, passes.favor.Options(features=32), learnable=True)
        runs.append(
            fit.fit_site(module, samples, scale=s.scale, causal=False, steps=40, lr=3e-2, seed=3, ce_weight=0.1)
        )
    assert runs[0].loss_after < runs[0].loss_before / 2
    assert runs[0].loss_after == runs[1].loss_after
    with pytest.raises(ValueError, match="HydraAttention cannot give its attention weights"):
        hydra = passes.hydra.torch_module(s, passes.hydra.Options(), learnable=True)
        fit.fit_site(hydra, samples, scale=s.scale, causal=False, steps=1, ce_weight=1.0)


def test_fx_calibration_of_swapped_multihead_attention_is_sequential_and_trainable():
    encoder = models.MODELS["torch-encoder-padded"].build()
    examples = [models.MODELS["torch-encoder-padded"].inputs(3, 10 + i) for i in range(3)]
    gm = attnrewrite.rewrite(encoder, to="hydra", calibrate=examples, calibrate_steps=15)
    sites = gm.meta["attnrewrite"]["sites"]
    assert [s["layer"] for s in sites] == [0, 1]
    assert all(s["calibration"]["loss_after"] < s["calibration"]["loss_before"] for s in sites)
    assert {s["calibration"]["tokens"] for s in sites} == {int(sum(e["attention_mask"].sum() for e in examples))}
    maps = [n for n, p in gm.named_parameters() if n.endswith(("query_map", "key_map"))]
    assert len(maps) == 4
    # sequential: layer 1 was fitted on activations of the model whose layer 0 is fitted, so
    # its loss before is the unfitted layer-1 module's on what the final model gives it
    layer1 = gm.get_submodule(sites[1]["replacement"].split(" at ")[1])
    samples = fit.SiteSamples()
    handle = layer1.register_forward_pre_hook(lambda _, args: samples.add(*args))
    with torch.no_grad():
        for example in examples:
            gm(**example)
    handle.remove()
    layer1_site = sites_of(sites)[1]
    fresh = passes.hydra.torch_module(layer1_site, passes.hydra.Options(), learnable=True)
    again = fit.fit_site(fresh, samples, scale=layer1_site.scale, causal=False, steps=0)
    assert again.loss_before == pytest.approx(sites[1]["calibration"]["loss_before"], rel=1e-6)


def sites_of(entries: list[dict]) -> list[AttentionSite]:
    """The sites a record's entries describe."""
    return [
        AttentionSite(
            s["name"],
            scale=s["scale"],
            mask=MaskKind(s["mask"]),
            rank=4,
            num_heads=s["num_heads"],
            head_dim=s["head_dim"],
            value_dim=s["value_dim"],
        )
        for s in entries
    ]


def test_a_site_whose_maps_cannot_be_built_is_left_alone_with_the_reason():
    spec = AttentionSpec(layout="3d", mask="key_padding")
    model = build_attention_model(spec)
    for value in model.graph.input[:3]:  # q, k, v: the head dimension is not known
        value.type.tensor_type.shape.dim[-1].dim_param = "d"
    assert attnrewrite.find_sites(model)[0].head_dim is None
    with pytest.warns(attnrewrite.errors.NothingRewritten):
        result = attnrewrite.rewrite(model, to="linear", calibrate=make_feeds(spec, batch=3, seq=6))
    (entry,) = read_record(result)["sites"]
    assert entry["status"] == "skipped"
    assert entry["reason"] == "cannot be calibrated: the head dimension is unknown, so no query/key map can be fitted"
