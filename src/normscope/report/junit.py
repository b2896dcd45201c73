"""JUnit XML of a check report, one testcase per finding, for CI systems."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from ..results.check import Report, Status
from .text import short


def write(report: Report, path: str | Path) -> None:
    """Write ``report`` as a JUnit ``testsuite`` to ``path``: failures and skips carry the finding's reason."""
    c = report.counts()
    undecided = report.undecided  # nothing tested: one failing testcase, so CI never reads all skips as a pass
    suite = ET.Element("testsuite", name=f"normscope check {report.target}",
                       tests=str(len(report.findings) + bool(undecided)),
                       failures=str(c["fail"] + c["inconclusive"] + bool(undecided)), skipped=str(c["skip"]),
                       time=f"{report.seconds:.3f}")
    for f in report.findings:
        case = ET.SubElement(suite, "testcase", classname=f"normscope.{f.section}", name=f.name)
        detail = (f"measured: {short(f.measured)}; expected: {short(f.expected)}; tolerance: "
                  f"{short(f.tolerance)}")
        if f.status == Status.FAIL:
            el = ET.SubElement(case, "failure", message=f.why)
            el.text = detail + ("\n" + "\n".join(report.differences) if report.differences else "")
        elif f.status == Status.INCONCLUSIVE:  # not a pass: CI must not read it as one
            el = ET.SubElement(case, "failure", message=f"inconclusive: {f.why}", type="inconclusive")
            el.text = detail
        elif f.status == Status.SKIP:
            ET.SubElement(case, "skipped", message=f.why)
        else:
            ET.SubElement(case, "system-out").text = detail
    if undecided:
        case = ET.SubElement(suite, "testcase", classname="normscope.check", name="nothing tested")
        ET.SubElement(case, "failure", message=f"inconclusive: {undecided[0]}", type="inconclusive")
    ET.ElementTree(ET.Element("testsuites")).getroot().append(suite)
    tree = ET.ElementTree(suite)
    ET.indent(tree)
    tree.write(str(path), encoding="utf-8", xml_declaration=True)
