"""Write deploy/k8s/monitoring/prometheusrule.yaml from deploy/prometheus/rules.yml.

    python deploy/k8s/monitoring/prometheusrule.py

The PrometheusRule's spec.groups are rules.yml's groups, unchanged; tests/test_deploy_k8s.py
fails when the two differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[1] / "prometheus" / "rules.yml"
OUT = HERE / "prometheusrule.yaml"
HEADER = """\
# deploy/prometheus/rules.yml as a Prometheus Operator object (spec.groups: that file's groups,
# unchanged).  Generated: after editing rules.yml run python deploy/k8s/monitoring/prometheusrule.py
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL expressions, descriptions) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    """The PrometheusRule document for the current rules.yml."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "lmcache-server", "labels": {"app.kubernetes.io/name": "lmcache-server"}},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000)


if __name__ == "__main__":
    OUT.write_text(render())
