"""Reading a real Prometheus page in the tests: every sample by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def val(m: dict, name: str, **labels) -> float:
    """One sample; a missing series fails with its name (no silent zero)."""
    key = (name, frozenset(labels.items()))
    assert key in m, f"no sample {name}{labels}; have {sorted({k[0] for k in m})}"
    return m[key]
