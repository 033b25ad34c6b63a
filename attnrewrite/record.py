"""What a rewrite did, kept with its output (ONNX metadata_props, GraphModule.meta) and printed;
and what a whole run did and how it ended, the ``--report`` file (docs/report.md)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from typing import Any

from attnrewrite.site import AttentionSite
from attnrewrite.version import __version__

METADATA_KEY = "attnrewrite"
REPORT_SCHEMA = "attnrewrite.report/1"


@dataclasses.dataclass
class SiteOutcome:
    site: AttentionSite
    rewritten: bool
    # Why the site was left alone: the site's own skip_reason, the method's refusal or the
    # layer selection. The report's one answer to "why not", so the site's skip_reason is not
    # repeated beside it.
    reason: str | None = None
    replacement: str | None = None  # e.g. "attnrewrite.Hydra"
    calibration: dict[str, Any] | None = None  # how the replacement was fitted, if it was
    exact_heads: list[int] | None = None  # heads the replacement computes by softmax (attnrewrite.passes.heads)

    @property
    def result(self) -> str:
        """What became of the site, in the table's words."""
        if not self.rewritten:
            return f"skipped: {self.reason}"
        if self.exact_heads:
            return f"{self.replacement} (heads {','.join(map(str, self.exact_heads))} exact)"
        return self.replacement

    def as_dict(self) -> dict[str, Any]:
        entry = {
            **self.site.describe(),
            # a site left alone without a reason is one --list found and could rewrite
            "status": "rewritten" if self.rewritten else "skipped" if self.reason else "rewritable",
            "reason": self.reason,
            "replacement": self.replacement,
        }
        if self.calibration is not None:  # uncalibrated records stay as they always were
            entry["calibration"] = self.calibration
        if self.exact_heads:
            entry["exact_heads"] = self.exact_heads
        return entry


@dataclasses.dataclass
class RewriteRecord:
    method: str
    options: dict[str, Any]
    outcomes: list[SiteOutcome] = dataclasses.field(default_factory=list)
    bytes_added: int = 0  # constants (random features, projections) the replacements store
    # what the run had to adapt to, one line each (e.g. inputs longer than asked for)
    notes: list[str] = dataclasses.field(default_factory=list)
    selection: dict[str, Any] | None = None  # --layers auto: what each site cost and why it was chosen
    end_to_end: dict[str, Any] | None = None  # calibration's stage that fitted all sites together
    finetune: dict[str, Any] | None = None  # stage 2: adapters on the projections (onnx/ and fx/finetune.py)
    # --recurrent: the state's bytes per sequence beside the KV cache's (passes.recurrent.StateMemory)
    state_memory: dict[str, Any] | None = None
    # per layer, the values calibration left in each replacement (what exact heads are sliced
    # from: attnrewrite.passes.heads); not part of the record as written
    fitted: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def rewritten(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if o.rewritten]

    @property
    def skipped(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if not o.rewritten]

    def as_dict(self) -> dict[str, Any]:
        return {
            "tool": f"attnrewrite {__version__}",
            "method": self.method,
            "options": self.options,
            "seed": self.options.get("seed"),
            "sites_found": len(self.outcomes),
            "sites_rewritten": len(self.rewritten),
            "bytes_added": self.bytes_added,
            "sites": [o.as_dict() for o in self.outcomes],
            **({"notes": self.notes} if self.notes else {}),
            **({"selection": self.selection} if self.selection is not None else {}),
            **({"end_to_end": self.end_to_end} if self.end_to_end is not None else {}),
            **({"finetune": self.finetune} if self.finetune is not None else {}),
            **({"state_memory": self.state_memory} if self.state_memory is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    def table(self) -> str:
        """The short human-readable table the CLI prints."""
        header = ("site", "layer", "heads", "mask", "result")
        rows = [
            (
                o.site.name,
                "-" if o.site.layer is None else str(o.site.layer),
                "-" if o.site.num_heads is None else str(o.site.num_heads),
                o.site.mask.value,
                o.result,
            )
            for o in self.outcomes
        ]
        return "\n".join([format_table(header, rows), *(f"note: {n}" for n in self.notes)])


# --- the run report -----------------------------------------------------------------------------

# How a run ended (docs/report.md). A model was produced only in the first two: there, and only
# there, a replaced site is "rewritten"; elsewhere it is "not_written".
WRITTEN = "written"  # the CLI wrote the output
RETURNED = "returned"  # the Python API returned the rewritten model
LISTED = "listed"  # --list / --list-options printed what was asked
CHECKED = "checked"  # ``attnrewrite check`` compared the models and every gate passed
REFUSED = "refused"  # nothing could be rewritten
GATE_FAILED = "gate_failed"  # the rewritten model failed a validation or fidelity gate
INPUT_FAILED = "input_failed"  # bad input: the arguments, the model file, the model itself
ERROR = "error"  # the environment (interrupted, out of memory, a file system error) or a bug


_measuring: contextvars.ContextVar[StageTimes | None] = contextvars.ContextVar("attnrewrite_stage_times", default=None)


class StageTimes:
    """Seconds spent in each stage of one run. Stages nest (layer selection checks inside its
    rewrite): time is charged to the innermost open stage only, so the figures add up."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []
        self._started = self._since = time.perf_counter()
        self._total: float | None = None
        self._failure: tuple[BaseException, str] | None = None  # the last error out of a stage, and where

    @contextlib.contextmanager
    def measuring(self) -> Iterator[StageTimes]:
        """Make these the times ``stage`` charges, in this thread or task, until the block ends."""
        token = _measuring.set(self)
        try:
            yield self
        finally:
            _measuring.reset(token)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._charge()
        self._open.append(name)
        try:
            yield
        except BaseException as error:
            if self.stage_of(error) is None:  # the innermost stage it (or the error it replaces) left
                self._failure = (error, name)
            raise
        finally:
            self._charge()
            self._open.pop()

    def stage_of(self, error: BaseException) -> str | None:
        """The stage ``error`` (or the error it was raised in handling) left; None: none."""
        while error is not None and self._failure is not None:
            if error is self._failure[0]:
                return self._failure[1]
            error = error.__context__
        return None

    def stop(self) -> None:
        self._total = time.perf_counter() - self._started

    def as_dict(self) -> dict[str, float]:
        total = self._total if self._total is not None else time.perf_counter() - self._started
        return {**{name: round(s, 6) for name, s in self.seconds.items()}, "total": round(total, 6)}

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] = self.seconds.get(self._open[-1], 0.0) + now - self._since
        self._since = now


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block as stage ``name`` of the run being measured (StageTimes.measuring); a no-op
    outside one, so library code can mark its stages whoever calls it."""
    times = _measuring.get()
    if times is None:
        yield
        return
    with times.stage(name):
        yield


@dataclasses.dataclass
class Report:
    """What one run did and how it ended: the CLI's ``--report`` file, ``Result.report`` and
    ``error.report`` in Python. The stages fill it in as they go, so a run that stops anywhere
    still says what it had found; ``end`` says how it stopped."""

    command: str  # "rewrite", "list" or "check"
    input: str | None = None  # the model read (check: the original); None: not a file
    compared: str | None = None  # check: the model compared with the input
    method: str | None = None  # as asked for; the record's name once there is one
    record: RewriteRecord | None = None
    fidelity: Any = None  # the check's attnrewrite.check.CheckReport
    state_memory: dict[str, Any] | None = None  # check: the compared model's record's (without a record here)
    thresholds: dict[str, float | None] = dataclasses.field(
        default_factory=lambda: {"min_cosine": None, "min_agreement": None}
    )
    notes: list[str] = dataclasses.field(default_factory=list)  # beyond the record's
    outcome: str | None = None
    exit_code: int | None = None
    reason: str | None = None  # the CLI's error line, without its "attnrewrite: error: "
    failed_stage: str | None = None  # the stage the run failed in
    output: str | None = None  # the file written (None unless it was)
    times: StageTimes = dataclasses.field(default_factory=StageTimes)

    def end(
        self,
        outcome: str,
        exit_code: int,
        reason: str | None = None,
        *,
        output: str | None = None,
        failed_stage: str | None = None,
    ) -> None:
        """How the run ended; ``output``: the file it wrote."""
        self.outcome, self.exit_code, self.reason = outcome, exit_code, reason
        self.output, self.failed_stage = output, failed_stage
        self.times.stop()

    @property
    def produced_model(self) -> bool:
        return self.outcome in (WRITTEN, RETURNED)

    def as_dict(self) -> dict[str, Any]:
        record = self.record.as_dict() if self.record is not None else {}
        sites = [self._final(site) for site in record.get("sites", [])]
        notes = record.get("notes", [])
        return {
            "schema": REPORT_SCHEMA,
            "tool": f"attnrewrite {__version__}",
            "command": self.command,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "failed_stage": self.failed_stage,
            "input": self.input,
            "compared": self.compared,
            "output": self.output,
            "method": record.get("method", self.method),
            "options": record.get("options"),
            "seed": record.get("seed"),
            "sites_found": record.get("sites_found"),  # None: detection did not finish
            "sites_rewritten": sum(site["status"] == "rewritten" for site in sites),
            "bytes_added": record.get("bytes_added", 0),
            "sites": sites,
            "notes": [*notes, *(n for n in self.notes if n not in notes)],
            "selection": record.get("selection"),
            "end_to_end": record.get("end_to_end"),
            "finetune": record.get("finetune"),
            "state_memory": record.get("state_memory", self.state_memory),
            "check": None if self.fidelity is None else self.fidelity.as_dict(**self.thresholds),
            "seconds": self.times.as_dict(),
        }

    def _final(self, site: dict[str, Any]) -> dict[str, Any]:
        """A site the rewrite replaced is "rewritten" only in a model the run produced."""
        if site["status"] == "rewritten" and not self.produced_model:
            return {**site, "status": "not_written"}
        return site

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n"


def record_json(record: RewriteRecord, earlier: str | None) -> str:
    """This run's record; the record of an earlier run on the same model is kept under
    "previous", so the file still says how every replacement in it was made."""
    if not earlier:
        return record.to_json()
    try:
        previous = json.loads(earlier)
    except ValueError:  # someone else's "attnrewrite" entry: kept, as the text it was
        previous = earlier
    return json.dumps({**record.as_dict(), "previous": previous}, sort_keys=True)


def json_float(value):
    """JSON has no NaN/inf: write them as strings so the file stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    # the last column is free text: do not pad it
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r[:-1], widths)) + "  " + str(r[-1]) for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def format_bytes(size: int) -> str:
    """1234567 -> "1.2 MB": sizes as a person reads them."""
    for unit in ("bytes", "kB", "MB"):
        if size < 1000:
            return f"{size} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def state_memory_line(memory: dict[str, Any]) -> str:
    """A recurrent rewrite's memory per sequence (RewriteRecord.state_memory) as one line: the
    state's bytes, and the KV cache they buy."""
    state, per_token, tokens = memory["state_bytes"], memory["kv_bytes_per_token"], memory["kv_tokens_equivalent"]
    layers = f"{memory['layers']} layer{'' if memory['layers'] == 1 else 's'}"
    said = f"{format_bytes(state)} per sequence ({state} bytes over {layers})" if state is not None else "not known"
    if tokens is not None:
        cache = f"the KV cache of {tokens} tokens ({per_token} bytes per token)"
    else:
        cache = (
            f"the KV cache {per_token} bytes per token"
            if per_token is not None
            else "the KV cache's bytes per token not known"
        )
    unknown = f" ({'; '.join(memory['unknown'])})" if memory.get("unknown") else ""
    return f"state: {said}, {cache}{unknown}"
