"""Namespace: canonical encoding (golden bytes), validation of every required field,
keyed vs public chain roots, generation, from_dict."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from kvstore.errors import InvalidArgument
from kvstore.namespace import KV_DTYPE_BYTES, Namespace, tenant_key

SPEC = dict(
    tenant="acme",
    name="chat",
    model_name="llama-3-8b",
    model_revision="rev-41",
    adapter_id="none",
    adapter_revision="none",
    tokenizer_id="llama-3",
    tokenizer_revision="tok-7",
    rope_type="llama3",
    rope_theta=500000.0,
    rope_scaling="factor=8",
    attention_impl="flash-attn-2",
    kv_dtype="bfloat16",
    prompt_template_version="tmpl-3",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    tp_rank=1,
    tp_size=2,
    block_size=16,
    public=False,
)

# Golden values: if one of these changes, every deployed node and client disagrees on
# block ids. Change them only together with the "kvns1" version magic.
GOLDEN_CANONICAL = (
    "6b766e73310400000061636d6504000000636861740a0000006c6c616d612d332d38620600000072"
    "65762d3431040000006e6f6e65040000006e6f6e65070000006c6c616d612d3305000000746f6b2d"
    "37060000006c6c616d61330000000080841e4108000000666163746f723d380c000000666c617368"
    "2d6174746e2d320800000062666c6f6174313606000000746d706c2d332000000000000000080000"
    "00000000008000000000000000010000000000000002000000000000001000000000000000"
    "00"
)
GOLDEN_ID = "f394adab859fe78013a0db2d627b588f"
GOLDEN_ROOT_GEN3 = "81c0646a42393ea07a626e31dcf74d58"

STR_FIELDS = [
    "tenant",
    "name",
    "model_name",
    "model_revision",
    "adapter_id",
    "adapter_revision",
    "tokenizer_id",
    "tokenizer_revision",
    "rope_type",
    "rope_scaling",
    "attention_impl",
    "kv_dtype",
    "prompt_template_version",
]
INT_FIELDS = ["num_layers", "num_kv_heads", "head_dim", "tp_size", "block_size"]


def ns(**kw) -> Namespace:
    return Namespace(**{**SPEC, **kw})


def test_canonical_encoding_matches_golden_bytes():
    spec = ns()
    assert spec.canonical_bytes().hex() == GOLDEN_CANONICAL
    assert spec.namespace_id.hex() == GOLDEN_ID
    assert spec.root(3, b"secret-a").hex() == GOLDEN_ROOT_GEN3


def test_canonical_encoding_follows_documented_layout():
    """Rebuild the bytes from the format in the module docstring, field by field."""
    out = [b"kvns1"]
    for f in dataclasses.fields(Namespace):
        v = SPEC[f.name]
        if isinstance(v, bool):
            out.append(bytes([v]))
        elif isinstance(v, str):
            out.append(struct.pack("<I", len(v.encode())) + v.encode())
        elif isinstance(v, float):
            out.append(struct.pack("<d", v))
        else:
            out.append(struct.pack("<Q", v))
    assert ns().canonical_bytes() == b"".join(out)


def test_encoding_is_deterministic_and_sensitive_to_every_field():
    base = ns()
    assert ns().canonical_bytes() == base.canonical_bytes()
    assert Namespace.from_dict(base.to_dict()).namespace_id == base.namespace_id
    changes = {f: SPEC[f] + "x" for f in STR_FIELDS if f != "kv_dtype"}
    changes.update({f: SPEC[f] * 2 for f in INT_FIELDS})
    changes.update(kv_dtype="float16", rope_theta=10000.0, tp_rank=0, public=True)
    ids = {base.namespace_id}
    for name, value in changes.items():
        ids.add(ns(**{name: value}).namespace_id)
    assert len(ids) == len(changes) + 1


def test_rope_theta_int_and_negative_zero_encode_like_floats():
    assert ns(rope_theta=500000).canonical_bytes() == ns().canonical_bytes()


@pytest.mark.parametrize("field", STR_FIELDS)
@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_string_field_is_refused_by_name(field, bad):
    with pytest.raises(InvalidArgument, match=rf"missing required fields.*\b{field}\b"):
        ns(**{field: bad})


@pytest.mark.parametrize("field", STR_FIELDS)
@pytest.mark.parametrize(
    "bad", ["evil\x1b[31mRED\x1b[0m", "two\nlines", "a\tb", "cr\rx", "a\u2028b", "\u202egnp.exe"]
)
def test_control_characters_in_a_string_field_are_refused_by_name(field, bad):
    """Names reach the operator's terminal (kvctl namespaces): a tenant's escape
    sequences must not recolour or rewrite it."""
    with pytest.raises(InvalidArgument, match=rf"namespace {field} must not contain control"):
        ns(**{field: bad})


@pytest.mark.parametrize(
    "name",
    [
        "chat v2 ünï",
        "no\u00a0break",  # a space of another kind
        "\u200cنیم\u200cفاصله",  # ZWNJ: ordinary Persian text
        "family \U0001f468\u200d\U0001f469\u200d\U0001f467",  # ZWJ in an emoji sequence
        "soft\u00adhyphen",
    ],
)
def test_spaces_joiners_and_non_ascii_letters_stay_allowed_in_names(name):
    assert ns(name=name, model_name="Llama 3 8B").name == name


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1])
def test_zero_int_field_is_refused_by_name(field, bad):
    with pytest.raises(InvalidArgument, match=rf"\b{field}\b"):
        ns(**{field: bad, "tp_rank": 0})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_rope_theta_must_be_positive_finite(bad):
    with pytest.raises(InvalidArgument, match="rope_theta"):
        ns(rope_theta=bad)


def test_several_missing_fields_are_all_named():
    with pytest.raises(InvalidArgument) as ei:
        ns(model_revision="", tokenizer_id="", head_dim=0, rope_theta=0.0)
    for name in ("model_revision", "tokenizer_id", "head_dim", "rope_theta"):
        assert name in str(ei.value)


@pytest.mark.parametrize(
    "rank,size,ok",
    [(0, 1, True), (1, 2, True), (2, 2, False), (-1, 2, False), (7, 8, True), (8, 8, False)],
)
def test_tp_rank_range(rank, size, ok):
    if ok:
        assert ns(tp_rank=rank, tp_size=size).tp_rank == rank
    else:
        with pytest.raises(InvalidArgument, match="tp_rank"):
            ns(tp_rank=rank, tp_size=size)


def test_unknown_kv_dtype_is_refused():
    with pytest.raises(InvalidArgument, match="kv_dtype 'fp4'"):
        ns(kv_dtype="fp4")


@pytest.mark.parametrize("dtype", sorted(KV_DTYPE_BYTES))
def test_bytes_per_token(dtype):
    spec = ns(kv_dtype=dtype)
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * KV_DTYPE_BYTES[dtype]
    assert spec.block_bytes == spec.bytes_per_token * 16


def test_block_size_limit_and_slashes():
    with pytest.raises(InvalidArgument, match="block_size"):
        ns(block_size=4097)
    with pytest.raises(InvalidArgument, match="'/'"):
        ns(tenant="a/b")
    with pytest.raises(InvalidArgument, match="tenant 'ac me' contains whitespace"):
        ns(tenant="ac me")
    with pytest.raises(InvalidArgument, match="public"):
        ns(public=1)


def test_keyed_roots_depend_on_the_tenant_secret():
    spec = ns()
    ra, rb = spec.root(0, b"secret-a"), spec.root(0, b"secret-b")
    assert len(ra) == 16 and ra != rb
    assert spec.root(0, "secret-a") == ra  # str and bytes secrets agree
    with pytest.raises(InvalidArgument, match="needs a secret"):
        spec.root(0, None)
    with pytest.raises(InvalidArgument, match="needs a secret"):
        spec.root(0, b"")
    # The same secret under another tenant name gives another key.
    assert tenant_key("acme", b"s") != tenant_key("other", b"s")


def test_public_roots_ignore_the_secret():
    spec = ns(public=True)
    r = spec.root(0, None)
    assert r == spec.root(0, b"secret-a") == spec.root(0, b"secret-b")
    assert r != ns().root(0, b"secret-a")


def test_generation_changes_the_root():
    spec = ns()
    roots = {spec.root(g, b"k") for g in range(5)}
    assert len(roots) == 5
    assert ns(public=True).root(1, None) != ns(public=True).root(2, None)
    with pytest.raises(InvalidArgument, match="generation"):
        spec.root(-1, b"k")


def test_from_dict_unknown_and_missing_fields():
    d = ns().to_dict()
    assert Namespace.from_dict(d) == ns()
    with pytest.raises(InvalidArgument, match="unknown namespace fields: colour"):
        Namespace.from_dict({**d, "colour": "blue"})
    partial = {k: v for k, v in d.items() if k not in ("model_name", "tp_size")}
    with pytest.raises(InvalidArgument, match="missing required fields: model_name, tp_size"):
        Namespace.from_dict(partial)
    # block_size and public have defaults and may be left out.
    short = {k: v for k, v in d.items() if k not in ("block_size", "public")}
    assert Namespace.from_dict(short).block_size == 16


def test_namespace_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns().tenant = "other"
