"""The registrar's /health check of an engine served over HTTPS (`kvctl cluster up --tls
--engines N`): it trusts the CA of its TLS files and presents their client pair, since
the engine requires a client certificate (vLLM --ssl-cert-reqs 2); a plaintext engine is
checked as before."""

from __future__ import annotations

import ssl

from kvstore.integrations.vllm_serve import etcd_tls, health_verify, parse_args
from kvstore.tls_ca import make_dev_pki


def test_an_https_engine_is_checked_against_the_ca_with_the_client_pair(tmp_path):
    make_dev_pki(str(tmp_path / "tls"))
    args, _ = parse_args(["--engine-id", "e0", "--url", "https://127.0.0.1:8000",
                          "--node-id", "agent-0", "--model", "tiny",
                          "--tls-dir", str(tmp_path / "tls")])  # fmt: skip
    ctx = health_verify(args.url, etcd_tls(args))
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    cas = ctx.get_ca_certs()  # the dev CA only, not the system's store
    assert [dict(x[0] for x in c["subject"])["commonName"] for c in cas] == ["kvstore dev CA"]


def test_a_plaintext_engine_or_no_tls_files_keep_httpx_defaults(tmp_path):
    pki = make_dev_pki(str(tmp_path / "tls"))
    assert health_verify("http://127.0.0.1:8000", pki.client) is True
    assert health_verify("https://engine.example:443", None) is True
