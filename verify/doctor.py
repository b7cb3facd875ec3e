"""mtpkit doctor: run the header checks (and optionally the deep scan), build the report
document, and render it for people."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtpkit import __version__
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.findings import SEVERITY_ORDER, Finding, finding
from mtpkit.loaders.model_check import check_model
from mtpkit.loaders.source import NotABundle
from mtpkit.loaders.template_sources import fallback_gaps
from mtpkit.verify.deep import Progress, deep_scan


def exit_code(findings: list[Finding], bundle: BundleView | None) -> int:
    if bundle is None:
        return 2
    return 1 if any(f.severity == "error" for f in findings) else 0


def report(target: str | Path, deep: bool = False,
           progress: Progress | None = None, on_open: Any = None) -> dict[str, Any]:
    """The doctor report for `target` as a dict valid against doctor_report.schema.json.

    on_open(view) is called once the headers are read (the CLI sizes its progress bar there).
    """
    try:
        view = open_bundle(target)
    except NotABundle as exc:
        findings = [finding("files.missing_config", str(exc), str(target), hint=exc.hint)]
        return _document(str(target), deep, None, findings)
    # what the loaders will do with the tensors (mlx-lm's model class, the decoder's head), and
    # a restored plain template that lacks what the model uses
    more = [*check_model(view), *fallback_gaps(view)]
    findings = sorted([*view.findings, *more],
                      key=lambda f: (SEVERITY_ORDER[f.severity], f.code, f.location))
    if deep:
        if on_open:
            on_open(view)
        findings += deep_scan(view, progress or (lambda n: None))
        findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.code, f.location))
    return _document(str(target), deep, view, findings)


def _document(target: str, deep: bool, view: BundleView | None,
              findings: list[Finding]) -> dict[str, Any]:
    count = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITY_ORDER}
    code = exit_code(findings, view)
    return {
        "tool": "mtpkit", "version": __version__, "command": "doctor", "target": target,
        "deep": deep, "bundle": view.summary() if view else None,
        "findings": [f.to_dict() for f in findings],
        "summary": {"errors": count["error"], "warnings": count["warning"],
                    "info": count["info"], "fixable": sum(1 for f in findings if f.fixable),
                    "ok": code == 0, "exit_code": code},
    }


def _describe(bundle: dict[str, Any]) -> list[str]:
    mtp, tpl, q = bundle["mtp"], bundle["template"], bundle["quantization"]
    trunk_q = ", ".join(f"{k} x{v}" for k, v in q["trunk"].items()) or "none (float)"
    side_q = ", ".join(f"{k} x{v}" for k, v in q["sidecar"].items()) or "none (float)"
    lines = [
        f"bundle    {bundle['kind']} checkpoint, model_type {bundle['model_type']} "
        f"(family {bundle['family']}); trunk {len(bundle['files']['trunk'])} file(s), "
        f"{bundle['tensors']['trunk']} tensors",
        f"quant     trunk: {trunk_q}",
    ]
    if mtp["present"]:
        lines.append(f"mtp       {mtp['tensor_count']} tensors in {mtp['location']}"
                     f" ({bundle['files']['sidecar'] or 'trunk shards'}), "
                     f"{mtp['blocks']} layer(s) (config: {mtp['declared_layers']})"
                     + (f", experts {mtp['expert_layout']} x{mtp['num_experts']}"
                        if mtp["expert_layout"] else "")
                     + (f", norms {mtp['norm_encoding']}" if mtp["norm_encoding"] else "")
                     + f"; quant: {side_q}")
    else:
        lines.append(f"mtp       none (config declares {mtp['declared_layers']})")
    drafter = bundle.get("drafter")
    if drafter:
        reads = ", ".join(f"{k.split('_')[0]} layer {v}" for k, v in drafter["reads"].items())
        lines.append(f"drafter   {drafter['kind']} in {drafter['path']}/, {drafter['layers']} "
                     f"layer(s) reading the target's K/V ({reads or 'no layer found'}), "
                     f"LM head {drafter['lm_head']}")
    if tpl["source"]:
        lines.append(f"template  {tpl['source']}: "
                     + ("renders" if tpl["renders"] else "does not render")
                     + (", thinking switch" if tpl["supports_thinking"] else "")
                     + (", generation prompt opens <think>"
                        if tpl["generation_prompt_opens_reasoning"] else ""))
    else:
        lines.append("template  none")
    return lines


def _repair_lines(applied: list[dict[str, str]]) -> list[str]:
    """What --fix did. Finding repairs are "fixed"; changes to the files that no finding asked
    for (convert/repair.py's repair.* notes) are named as such, so "copied as is" is said only
    when every file of the copy is the source's, byte for byte."""
    if not applied:
        return ["  fixed     nothing to repair; copied as is (every file byte for byte)"]
    fixes = [a for a in applied if not a["code"].startswith("repair.")]
    lines = [f"  fixed     {a['code']}: {a['action']}" for a in fixes] or [
        "  fixed     nothing to repair"]
    lines += [f"  {a['code'].removeprefix('repair.'):<9} {a['action']}" for a in applied
              if a["code"].startswith("repair.")]
    return lines


def render_text(doc: dict[str, Any]) -> str:
    lines = [f"mtpkit doctor {doc['target']}" + (" --deep" if doc["deep"] else "")]
    if "repair" in doc:
        fix = doc["repair"]
        lines.append(f"  repaired {fix['source']} -> {fix['out']} (source untouched)")
        lines += _repair_lines(fix["applied"])
        lines.append("  the copy:")
    if doc["bundle"]:
        lines += ["  " + line for line in _describe(doc["bundle"])]
    findings = doc["findings"]
    if findings:
        width = max(len(f["code"]) for f in findings)
        lines.append("")
        for f in findings:
            loc = f" [{f['location']}]" if f["location"] else ""
            lines.append(f"  {f['severity']:<7} {f['code']:<{width}}  {f['message']}{loc}")
            if f["severity"] != "info":
                lines.append(f"  {'':<7} {'':<{width}}  hint: {f['hint']}")
    s = doc["summary"]
    verdict = "OK" if s["ok"] else ("NOT A MODEL FOLDER" if s["exit_code"] == 2 else "PROBLEMS")
    lines += ["", f"{verdict}: {s['errors']} error(s), {s['warnings']} warning(s), "
              f"{s['info']} note(s); {s['fixable']} fixable"]
    return "\n".join(lines)
