"""``attnrewrite check ORIGINAL REWRITTEN --against-window``: a rewritten decoder scored beside
the cheapest thing its state's bytes buy, the KV cache cut to a window (StreamingLLM; issue 68).

The baseline is ORIGINAL rewritten ``--to streaming`` in memory, over the sites REWRITTEN
replaced: exact softmax over the first SINKS real keys and the last ``tokens - SINKS``, where
``tokens`` is the KV cache REWRITTEN's recurrent state buys (passes/recurrent.py's StateMemory:
the record's, as the rewrite's summary said it, or for a parallel rewrite its method's recurrent
form's). It is the parallel form, so it takes ORIGINAL's inputs and carries ORIGINAL's cache. The
three models run on the same inputs (longer than both REWRITTEN's exact part and the window,
check.default_length), and each of the two is compared with ORIGINAL as check compares.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir

from attnrewrite import decision, passes
from attnrewrite.check import (
    DEFAULT_BATCH,
    CheckReport,
    as_ir,
    check_inputs,
    exact_sites,
    is_recurrent,
    model_record,
    recorded_method,
    replaced_sites,
    run_compared,
    table_header,
    table_row,
)
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import find_sites, rewrite_model
from attnrewrite.passes import recurrent, streaming
from attnrewrite.record import format_bytes, format_table, stage, state_memory_line
from attnrewrite.site import AttentionSite

SINKS = streaming.Options().sinks  # the window's kept first tokens: streaming's default
FLAG = "--against-window"
NO_STATE = f"{FLAG}: the rewritten model has no attention state to weigh against a window"


@dataclasses.dataclass
class WindowBaseline:
    """The window of the rewritten model's bytes, and how it compares with the original."""

    memory: dict[str, Any]  # the rewritten model's state per sequence (StateMemory.as_dict)
    recent: int
    sinks: int
    fidelity: CheckReport  # the window against the original, on the same inputs

    @property
    def tokens(self) -> int:
        return self.recent + self.sinks

    def line(self) -> str:
        return (
            f"window: streaming recent={self.recent}, sinks={self.sinks}, the KV cache of {self.tokens} tokens "
            f"({self.memory['kv_bytes_per_token']} bytes per token), as many as the rewritten model's "
            f"{format_bytes(self.memory['state_bytes'])} state per sequence buys"
        )

    def as_dict(self) -> dict[str, Any]:
        compared = self.fidelity.as_dict()
        return {
            "method": streaming.NAME,
            "recent": self.recent,
            "sinks": self.sinks,
            "kv_tokens": self.tokens,
            "state_memory": self.memory,
            **{key: compared[key] for key in ("exact_sites", "observed", "outputs")},
        }


@dataclasses.dataclass
class WindowedCheckReport(CheckReport):
    """The rewritten model against the original (the CheckReport's own figures, which the gates
    read) and ``window``, the window of the same bytes against the original."""

    window: WindowBaseline | None = None

    def table(self) -> str:
        with_logits = bool(self.logits_outputs())
        output, *columns = table_header(with_logits)
        windowed = {o.name: o for o in self.window.fidelity.outputs}
        rows = []
        for rewritten in self.outputs:
            for model, fidelity in (("rewritten", rewritten), ("window", windowed[rewritten.name])):
                name, *figures = table_row(fidelity, with_logits)
                rows.append((name, model, *figures))
        lines = [format_table((output, "model", *columns), rows), self.window.line()]
        lines += [f"inputs: {self.input_source}", *self.footer(), *self.window.fidelity.footer("window")]
        return "\n".join(lines)

    def as_dict(
        self, min_cosine: float | None = None, min_agreement: float | None = None, allow_exact: bool = False
    ) -> dict[str, Any]:
        return {**super().as_dict(min_cosine, min_agreement, allow_exact), "window": self.window.as_dict()}


def check_against_window(
    original,
    rewritten,
    inputs=None,
    *,
    seq: int | None = None,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    threads: int | None = None,
) -> WindowedCheckReport:
    """``check(original, rewritten, ...)`` (same arguments) beside the window baseline of the
    rewritten model's state bytes; AttnRewriteError (one line) where there is no state to weigh
    or it buys fewer than SINKS + 1 tokens."""
    with stage("check"):
        record = model_record(rewritten)
        memory, sites = weighed_state(record, original)
        options = window_options(memory)
        baseline, baseline_record = window_model(original, sites, options)
        also_exact = [passes.exact_part(streaming, options, causal=True)]
        inputs = check_inputs(original, record, inputs, seq=seq, batch=batch, seed=seed, also_exact=also_exact)
        compared = [(rewritten, "the rewritten model"), (baseline, "the window baseline")]
        report, window = run_compared(original, compared, inputs, threads)
        decoding = is_recurrent(record)
        report.exact = exact_sites(record, inputs, original, decoding)
        window.exact = exact_sites(baseline_record, inputs, original, decoding)
        fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(CheckReport)}
        return WindowedCheckReport(**fields, window=WindowBaseline(memory, options.recent, options.sinks, window))


def weighed_state(record: dict | None, original) -> tuple[dict[str, Any], list[AttentionSite]]:
    """(the state per sequence of the rewrite ``record`` says was made, StateMemory.as_dict; the
    original's sites it replaced), or AttnRewriteError saying why there is none to weigh."""
    if record is None:
        raise AttnRewriteError(f"{FLAG} weighs a rewrite's state: the rewritten model has no attnrewrite record")
    if "previous" in record:
        raise AttnRewriteError(f"{FLAG} weighs one rewrite's state: the rewritten model was rewritten more than once")
    recorded = recorded_method(record)
    if recorded is None:
        raise AttnRewriteError(
            f"{FLAG}: this version does not read the rewritten model's record ({record.get('method')})"
        )
    method, options = recorded
    sites = _replaced_in(original, record)
    plan = decision.RunPlan.of(streaming.Options(), include_single_query=True)
    for site in sites:
        reason = decision.refusal(site, plan)
        if reason is not None:
            raise AttnRewriteError(f"{NO_STATE}: its site {site.name!r}: {reason}")
    reason = recurrent.recurrent_refusal(method, options)
    if reason is not None:
        raise AttnRewriteError(f"{NO_STATE}: {method.NAME} has no recurrent form ({reason})")
    memory = record.get("state_memory") or recurrent.rewrite_memory(method, options, sites).as_dict()
    return memory, sites


def _replaced_in(original, record: dict) -> list[AttentionSite]:
    """The original's sites ``record`` says were replaced, found in the original again."""
    names = [site["name"] for site in replaced_sites(record)]
    if not names:
        raise AttnRewriteError(f"{NO_STATE}: its record says no site was replaced")
    found = {site.name: site for site in find_sites(as_ir(original))}
    missing = [name for name in names if name not in found]
    if missing:
        raise AttnRewriteError(
            f"{FLAG}: the rewritten model replaced {missing[0]!r}, which the original has no site of: "
            "is it the model the rewrite was made from?"
        )
    return [found[name] for name in names]


def window_options(memory: dict[str, Any]) -> streaming.Options:
    """Streaming's options for the KV cache of ``memory``'s tokens: SINKS sinks, the rest recent."""
    tokens = memory["kv_tokens_equivalent"]
    if tokens is None:
        raise AttnRewriteError(f"{FLAG}: no window of the rewritten model's bytes: {state_memory_line(memory)}")
    if tokens < SINKS + 1:
        raise AttnRewriteError(
            f"{FLAG}: the rewritten model's state ({memory['state_bytes']} bytes per sequence) buys the KV cache "
            f"of {tokens} token{'' if tokens == 1 else 's'}, fewer than a window's {SINKS} sinks and 1 recent key"
        )
    return streaming.Options(recent=tokens - SINKS, sinks=SINKS)


def window_model(original, sites: list[AttentionSite], options: streaming.Options) -> tuple[ir.Model, dict]:
    """(the original rewritten in memory by streaming with ``options`` at ``sites``, in the
    parallel form; its record)."""
    model = onnx_io.from_proto(ir.to_proto(original)) if isinstance(original, ir.Model) else None
    model = model or onnx_io.load_model(original)
    layers = [site.layer for site in sites]
    plan = decision.RunPlan.of(options, layers=None if None in layers else layers, include_single_query=True)
    model, record = rewrite_model(model, plan)
    return model, record.as_dict()
