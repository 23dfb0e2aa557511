"""`cache_salt` → namespace and chain-root secret: one definition for the vLLM connector
(kvstore/integrations/vllm_agent.py) and the gateway (router/gateway/), which must compute
the same block ids for a salted request as the engine does."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from kvstore.namespace import Namespace

__all__ = ["salted", "salt_secret"]

_SALT_PERSON = b"kvstore-vllmsalt"


def salted(spec: Namespace, salt: str | None) -> Namespace:
    """A request's `cache_salt` gets its own namespace: salts never share block ids."""
    if not salt:
        return spec
    tag = hashlib.blake2b(salt.encode(), digest_size=8, person=_SALT_PERSON).hexdigest()
    return replace(spec, name=f"{spec.name}.salt-{tag}")


def salt_secret(secret: str, salt: str | None) -> str:
    """The chain-root secret of a salted namespace: the tenant secret keyed by the salt, so
    one salt's block ids cannot be computed from another's."""
    if not salt:
        return secret
    key = hashlib.blake2b(secret.encode(), digest_size=32).digest()
    return hashlib.blake2b(salt.encode(), digest_size=32, key=key, person=_SALT_PERSON).hexdigest()
