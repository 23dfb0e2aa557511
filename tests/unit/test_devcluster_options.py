"""kvctl cluster up's options: --tls with the gateway (it serves HTTPS from the router's
files) is accepted, and so is --tls with vLLM engines (they serve HTTPS and present the
dev CA's client pair; docs/tls.md); out-of-range counts are refused with the reason."""

from __future__ import annotations

import pytest

from kvstore.devcluster import UpOptions


def test_tls_with_the_gateway_alone_is_accepted():
    opts = UpOptions(tls=True, gateway_tokenizers=(("tiny", "/models/tiny"),))
    assert opts.tls and opts.gateway_tokenizers


def test_tls_with_engines_is_accepted():
    opts = UpOptions(tls=True, engines=1)
    assert opts.tls and opts.engines == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tls": True, "engines": 9}, "--engines must be between 0 and 8, got 9"),
        ({"tls": True, "engines": -1}, "--engines must be between 0 and 8, got -1"),
        ({"tls": True, "engines": 1, "agents": 0}, "--agents must be between 1 and 64, got 0"),
    ],
)
def test_bad_counts_with_tls_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UpOptions(**kwargs)
