"""The vLLM connector's pure parts, without vLLM: settings, the namespace derived from an
engine config (read by attribute, so a plain record stands in for vLLM's), cache_salt
isolation, and the copies between vLLM's paged CPU cache and kvstore blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvstore.integrations.vllm_config import (
    ConnectorSettings,
    NamespaceRefused,
    engine_namespace,
    salt_secret,
    salted,
)
from kvstore import native
from kvstore.integrations.vllm_layout import PagedLayout, UnsupportedLayout

EXTRA = {"agent": "127.0.0.1:1", "tenant": "acme", "tenant_secret": "s3cret"}


@dataclass
class _Model:
    model: str
    tokenizer: str
    revision: str | None = None
    tokenizer_revision: str | None = None
    dtype: torch.dtype = torch.float32
    hf_config: object = field(
        default_factory=lambda: SimpleNamespace(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
    )

    def get_num_layers(self, pc) -> int:
        return 2

    def get_num_kv_heads(self, pc) -> int:
        return 2

    def get_head_size(self) -> int:
        return 32


def _config(model: _Model, lora=None, cache_dtype="auto"):
    return SimpleNamespace(
        model_config=model,
        lora_config=lora,
        cache_config=SimpleNamespace(block_size=32, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
    )


def _model_dir(tmp_path, weights: bytes):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(weights)
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def test_settings_name_what_is_missing(tmp_path):
    with pytest.raises(
        NamespaceRefused, match="lacks agent, tenant, tenant_secret or tenant_secret_file"
    ):
        ConnectorSettings.from_extra({})
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    s = ConnectorSettings.from_extra(
        {"agent": "h:1", "tenant": "t", "tenant_secret_file": str(secret), "shm_mib": 8}
    )
    assert (s.tenant_secret, s.shm_bytes, s.token) == ("from-file", 8 << 20, None)
    with pytest.raises(NamespaceRefused, match="cannot read"):
        ConnectorSettings.from_extra(
            {**EXTRA, "tenant_secret": "", "tenant_secret_file": str(tmp_path / "none")}
        )


def test_namespace_comes_from_the_engine_config(tmp_path):
    settings = ConnectorSettings.from_extra(EXTRA)
    path = _model_dir(tmp_path, b"weights-1")
    ns = engine_namespace(_config(_Model(path, path)), settings, 0, "0.32.0")
    assert (ns.tenant, ns.name, ns.model_name, ns.kv_dtype) == ("acme", "vllm", path, "float32")
    assert (ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.block_size) == (2, 2, 32, 32)
    assert ns.attention_impl == "vllm-0.32.0-cpu" and ns.model_revision.startswith("local-")
    # A local model without a revision is named by its content: new weights, new namespace.
    (tmp_path / "m" / "model.safetensors").write_bytes(b"weights-2")
    other = engine_namespace(_config(_Model(path, path)), settings, 0, "0.32.0")
    assert other.model_revision != ns.model_revision
    assert other.tokenizer_revision == ns.tokenizer_revision
    given = engine_namespace(_config(_Model(path, path, revision="abc")), settings, 0, "x")
    assert given.model_revision == "abc"


def test_namespace_refusals_say_why(tmp_path):
    settings = ConnectorSettings.from_extra(EXTRA)
    with pytest.raises(NamespaceRefused, match="'org/model' has no revision"):
        engine_namespace(_config(_Model("org/model", "org/model")), settings, 0, "x")
    path = _model_dir(tmp_path, b"w")
    with pytest.raises(NamespaceRefused, match="LoRA"):
        engine_namespace(_config(_Model(path, path), lora=object()), settings, 0, "x")
    with pytest.raises(NamespaceRefused, match="'int4' is not one kvstore stores"):
        engine_namespace(_config(_Model(path, path), cache_dtype="int4"), settings, 0, "x")
    swa = _Model(
        path,
        path,
        hf_config=SimpleNamespace(rope_parameters={"rope_theta": 1e4}, sliding_window=128),
    )
    with pytest.raises(NamespaceRefused, match="sliding-window"):
        engine_namespace(_config(swa), settings, 0, "x")


def test_cache_salts_get_their_own_namespace_and_root(tmp_path):
    path = _model_dir(tmp_path, b"w")
    ns = engine_namespace(_config(_Model(path, path)), ConnectorSettings.from_extra(EXTRA), 0, "x")
    assert salted(ns, None) == ns and salted(ns, "") == ns
    s1, s2 = salted(ns, "one"), salted(ns, "two")
    assert len({ns.namespace_id, s1.namespace_id, s2.namespace_id}) == 3
    assert "/" not in s1.name and "one" not in s1.name  # the salt itself is not exposed
    roots = {
        s1.root(0, salt_secret("s3cret", "one")),
        s1.root(0, salt_secret("s3cret", "x")),
        s1.root(0, "s3cret"),
    }
    assert len(roots) == 3


def _cpu_cache(blocks=6, heads=2, bs=32, hd=32):
    return torch.randn(blocks, heads, bs, 2 * hd)


@pytest.fixture(params=["native", "torch"])
def copies(request, monkeypatch):
    """CPU copies in the native extension, or torch's (its fallback)."""
    if request.param == "native" and native.load().module is None:
        pytest.skip("kvstore._native is not built")
    if request.param == "torch":
        monkeypatch.setenv(native.OFF_ENV, "1")
    return request.param


def test_cpu_copies_are_native_where_the_extension_is_built():
    layers = [_cpu_cache(), _cpu_cache()]
    built = native.load().module is not None
    assert (PagedLayout.detect(layers, 32, 2, 32).native is not None) == built
    # A layer that is not one contiguous tensor takes torch's copy, and lands the same.
    strided = [torch.randn(12, 2, 32, 64)[::2] for _ in range(2)]  # every other block
    layout = PagedLayout.detect(strided, 32, 2, 32)
    assert layout.native is None
    out = torch.empty(2, 2, 2, 32, 2, 32)
    PagedLayout.detect(layers, 32, 2, 32).gather([3, 0], out)
    layout.scatter([1, 4], out)
    assert torch.equal(strided[0][1], layers[0][3]) and torch.equal(strided[1][4], layers[1][0])


def test_cpu_layout_round_trip_and_kernel_view(copies):
    layers = [_cpu_cache(), _cpu_cache()]
    layout = PagedLayout.detect(layers, 32, 2, 32)
    assert (layout.native is not None) == (copies == "native")
    out = torch.empty(2, 2, 2, 32, 2, 32)  # (n, layers, K/V, block, heads, head_dim)
    layout.gather([4, 1], out)
    # The CPU kernel reads a block as (heads, 2 * block, head_dim): K rows, then V rows.
    kernel = layers[1].view(6, 2, 64, 32)
    k, v = kernel[4].chunk(2, dim=1)
    assert torch.equal(out[0, 1, 0], k.transpose(0, 1))
    assert torch.equal(out[0, 1, 1], v.transpose(0, 1))
    fresh = [torch.zeros_like(x) for x in layers]
    PagedLayout.detect(fresh, 32, 2, 32).scatter([2, 5], out)
    assert torch.equal(fresh[0][2], layers[0][4]) and torch.equal(fresh[1][5], layers[1][1])
    assert not fresh[0][0].any()


@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_consecutive_and_scattered_block_ids_copy_alike(kind, copies):
    """A run of consecutive ids (one narrow copy per layer) and scattered ids (index_copy)
    write and read the same bytes as the kernel's own view of a block."""

    def cache():
        if kind == "cpu":
            return _cpu_cache(blocks=8)
        return torch.randn(2, 8, 32, 2, 32)

    layers = [cache() for _ in range(3)]
    layout = PagedLayout.detect(layers, 32, 2, 32)
    assert layout.kind == kind
    for ids in ([2, 3, 4], [6, 1, 3]):
        out = torch.empty(3, 3, 2, 32, 2, 32)
        layout.gather(ids, out)
        fresh = [torch.zeros_like(x) for x in layers]
        PagedLayout.detect(fresh, 32, 2, 32).scatter(ids, out)
        for src, dst in zip(layers, fresh):
            for b in ids:
                got, want = (dst[b], src[b]) if kind == "cpu" else (dst[:, b], src[:, b])
                assert torch.equal(got, want)
            untouched = [b for b in range(8) if b not in ids]
            assert not (dst[untouched] if kind == "cpu" else dst[:, untouched]).any()
        if kind == "cpu":  # K of token 0, head 1, is the kernel's row 0 of head 1
            assert torch.equal(out[0, 0, 0, 0, 1], layers[0][ids[0]].view(2, 64, 32)[1, 0])


def test_unknown_layout_is_refused():
    with pytest.raises(UnsupportedLayout, match="not a layout kvstore knows"):
        PagedLayout.detect([torch.zeros(4, 32, 2, 64)], 32, 2, 32)


def test_kv_transfer_params_peer_hint():
    from kvstore.integrations.vllm_peer import PeerHint, hint_from_params

    assert hint_from_params(None) is None and hint_from_params({"other": 1}) is None
    assert hint_from_params({"kvstore": {"peer": "10.0.0.7:50051"}}) == PeerHint("10.0.0.7:50051")
    both = {"kvstore": {"peer": "h:1", "peer_transfer": "h:2"}}
    assert hint_from_params(both) == PeerHint("h:1", "h:2")
    for bad in ({"kvstore": "h:1"}, {"kvstore": {"peer": 7}}, {"kvstore": {"peer": "nohost"}}):
        assert hint_from_params(bad) is None  # ignored (logged): the request recomputes


def test_extra_config_router_and_pull_timeout():
    s = ConnectorSettings.from_extra({**EXTRA, "router": "127.0.0.1:7", "pull_timeout_s": 3})
    assert (s.router, s.pull_timeout_s) == ("127.0.0.1:7", 3.0)
    d = ConnectorSettings.from_extra(EXTRA)
    assert (d.router, d.pull_timeout_s) == (None, 10.0)


def test_cpu_copies_of_many_blocks_land_every_block_once(copies):
    """Loads and saves of many blocks (4096 elements per block and layer here: copied in
    pieces of 7, vllm_layout._chunks) land right: pieces that start mid-run, runs broken
    across pieces, scattered ids."""
    layers = [_cpu_cache(blocks=40) for _ in range(2)]
    layout = PagedLayout.detect(layers, 32, 2, 32)
    ids = list(range(3, 20)) + [39, 25, 21] + list(range(30, 37))
    out = torch.empty(len(ids), 2, 2, 32, 2, 32)
    layout.gather(ids, out)
    fresh = [torch.zeros_like(x) for x in layers]
    PagedLayout.detect(fresh, 32, 2, 32).scatter(ids, out)
    for src, dst in zip(layers, fresh):
        assert torch.equal(dst[ids], src[ids])
        assert not dst[[b for b in range(40) if b not in ids]].any()


def test_extra_config_tls_files_are_checked_when_read(tmp_path):
    from kvstore.tls_ca import make_dev_pki

    assert ConnectorSettings.from_extra(EXTRA).tls is None
    d = tmp_path / "tls"
    make_dev_pki(str(d))
    s = ConnectorSettings.from_extra({**EXTRA, "tls_dir": str(d), "tls_server_name": "kv.svc"})
    assert s.tls is not None
    assert (s.tls.ca_file, s.tls.cert_file, s.tls.server_name) == (
        str(d / "ca.crt"),
        str(d / "client.crt"),
        "kv.svc",
    )
    files = {"tls_ca_file": str(d / "ca.crt"), "tls_cert_file": str(d / "client.crt")}
    with pytest.raises(NamespaceRefused, match="tls_key_file must be set with"):
        ConnectorSettings.from_extra({**EXTRA, **files})
    with pytest.raises(NamespaceRefused, match="cannot read the private key"):
        ConnectorSettings.from_extra({**EXTRA, **files, "tls_key_file": str(d / "none.key")})
    with pytest.raises(NamespaceRefused, match="not both"):
        ConnectorSettings.from_extra({**EXTRA, **files, "tls_dir": str(d)})
    with pytest.raises(NamespaceRefused, match="tls_server_name needs the TLS files"):
        ConnectorSettings.from_extra({**EXTRA, "tls_server_name": "kv.svc"})
