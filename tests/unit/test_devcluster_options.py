"""kvctl cluster up's options: --tls with the gateway (it serves HTTPS from the router's
files) is accepted; --tls with vLLM engines is refused until the connector on main takes
TLS files (docs/tls.md)."""

from __future__ import annotations

import pytest

from kvstore.devcluster import UpOptions


def test_tls_with_the_gateway_alone_is_accepted():
    opts = UpOptions(tls=True, gateway_tokenizers=(("tiny", "/models/tiny"),))
    assert opts.tls and opts.gateway_tokenizers


def test_tls_with_engines_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="--tls cannot be combined with --engines yet"):
        UpOptions(tls=True, engines=2)
