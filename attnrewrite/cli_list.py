"""The listings: ``attnrewrite MODEL --list`` (the attention sites found, and why each is or is
not rewritable) and ``attnrewrite --to M --list-options`` (a method's declared options)."""

from __future__ import annotations

from attnrewrite import passes, pipeline
from attnrewrite.cli_parsing import parse_options
from attnrewrite.data import load_inputs
from attnrewrite.decision import RunPlan, refusal
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.masks import probe_note
from attnrewrite.onnx.rewrite import analyze
from attnrewrite.passes.recurrent import rewrite_memory
from attnrewrite.record import LISTED, Report, RewriteRecord, SiteOutcome, format_table, stage, state_memory_line
from attnrewrite.state_budget import fit as fit_budget


def list_sites(model, args, report: Report) -> int:
    given = load_inputs(args.inputs, model.graph) if args.inputs else None
    with stage("detect"):
        sites = analyze(onnx_io.infer_shapes(model), seq=pipeline.probe_seq(args.seq, model.graph, given))
    record = RewriteRecord("none", {}, [SiteOutcome(s.site, rewritten=False, reason=s.site.skip_reason) for s in sites])
    report.record = record
    header = ("site", "layer", "heads", "head_dim", "mask", "scale", "status")
    rows = [
        (
            s.site.name,
            str(s.site.layer),
            "-" if s.site.num_heads is None else str(s.site.num_heads),
            "-" if s.site.head_dim is None else str(s.site.head_dim),
            s.site.mask_label,
            f"{s.site.scale:.4g}",
            "rewritable" if s.site.skip_reason is None else f"unsupported: {s.site.skip_reason}",
        )
        for s in sites
    ]
    print(format_table(header, rows))
    print(f"{len(sites)} attention sites, {sum(s.site.skip_reason is None for s in sites)} rewritable")
    note = probe_note([s.site for s in sites])
    if note:
        print(f"note: {note}")
    if args.to and args.recurrent:
        options = parse_options(args.option)
        if args.state_budget is not None:
            options = _budgeted(args, options, [s.site for s in sites])
        print(_state_line(args.to, options, [s.site for s in sites], record))
    report.end(LISTED, 0)
    return 0


def _state_line(method_name: str, options: dict[str, str], sites: list, record: RewriteRecord) -> str:
    """What the recurrence of ``method_name`` with ``options`` would keep per sequence over the
    sites a rewrite with them replaces, said and kept in ``record`` (its state_memory)."""
    plan = RunPlan.of(method_name, recurrent=True, **options)
    reasons = [refusal(site, plan) for site in sites]
    replaced = [site for site, reason in zip(sites, reasons) if reason is None]
    if not replaced:
        why = next((reason for reason in reasons if reason), "no attention sites")
        return f"state: none, no site becomes a recurrence of {plan.method.NAME} ({why})"
    record.state_memory = rewrite_memory(plan.method, plan.options, replaced).as_dict()
    return state_memory_line(record.state_memory)


def _budgeted(args, options: dict[str, str], sites: list) -> dict:
    """The options ``--state-budget`` chooses over the sites a rewrite would replace, said."""
    choice = fit_budget(args.to, options, sites, args.state_budget)
    print(choice.describe())
    return choice.options


def print_options(args, report: Report) -> int:
    from attnrewrite.passes.options import describe_options

    if not args.to:
        raise AttnRewriteError(f"--list-options needs --to METHOD (one of: {', '.join(passes.PASSES)})")
    method = passes.get_pass(args.to)
    rows = [(o.name, o.type, str(o.default), o.valid or "-", o.help) for o in describe_options(method.Options)]
    print(f"options of {method.NAME} (set with -O NAME=VALUE):")
    print(format_table(("name", "type", "default", "valid", "meaning"), rows))
    report.end(LISTED, 0)
    return 0
