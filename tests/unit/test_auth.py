"""The one access rule (kvstore/auth.py check_namespace): who may use which namespace, on
the data plane and for peer transfer, decided from the identity and the spec alone."""

from __future__ import annotations

import pytest
from support.common import make_namespace

from kvstore import errors
from kvstore.auth import AGENT_TENANT, CLUSTER_TENANT, NOT_YOURS, check_namespace

PRIVATE = make_namespace(tenant="acme", name="chat")
PUBLIC = make_namespace(tenant="acme", name="docs", public=True)

# (caller, spec, write, peer) -> allowed
CASES = [
    ("acme", PRIVATE, True, False, True),
    ("acme", PRIVATE, False, True, True),
    ("globex", PRIVATE, False, False, False),
    ("globex", PRIVATE, False, True, False),
    ("globex", PUBLIC, False, False, True),
    ("globex", PUBLIC, True, False, False),
    ("globex", None, False, False, False),
    ("acme", None, False, False, False),  # not open here: it cannot be told from foreign
    (CLUSTER_TENANT, PRIVATE, False, False, False),
    (CLUSTER_TENANT, PRIVATE, False, True, False),  # the router's token reads no payloads
    (CLUSTER_TENANT, PUBLIC, False, True, False),
    (AGENT_TENANT, PRIVATE, False, True, True),
    (AGENT_TENANT, PRIVATE, True, True, True),
    (AGENT_TENANT, None, False, True, True),  # the store then answers NOT_FOUND
    (AGENT_TENANT, PRIVATE, False, False, False),  # peers have no data-plane access
    (None, PRIVATE, True, False, True),  # development: unauthenticated
]


@pytest.mark.parametrize("caller,spec,write,peer,allowed", CASES)
def test_check_namespace(caller, spec, write, peer, allowed):
    if allowed:
        check_namespace(caller, spec, write, peer)
        return
    with pytest.raises(errors.PermissionDenied):
        check_namespace(caller, spec, write, peer)


def test_unknown_and_foreign_namespaces_get_one_message():
    messages = set()
    for spec in (PRIVATE, None):
        with pytest.raises(errors.PermissionDenied) as ei:
            check_namespace("globex", spec, write=False)
        messages.add(str(ei.value))
    assert messages == {NOT_YOURS}
