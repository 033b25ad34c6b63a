"""What a rewrite did, kept with its output (ONNX metadata_props, GraphModule.meta) and printed."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from attnrewrite.site import AttentionSite

METADATA_KEY = "attnrewrite"


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

    @property
    def rewritten(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if o.rewritten]

    @property
    def skipped(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if not o.rewritten]

    def as_dict(self) -> dict[str, Any]:
        from attnrewrite import __version__

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
                o.replacement if o.rewritten else f"skipped: {o.reason}",
            )
            for o in self.outcomes
        ]
        return "\n".join([format_table(header, rows), *(f"note: {n}" for n in self.notes)])


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
