"""Which cluster a kvctl command talks to when it is not told.

`make run` and `kvctl cluster up` record a local cluster (its etcd, router, agents) in
STATE_DIR/cluster.json, STATE_DIR being .state/cluster by default. So that a bare
`kvctl status` after `make run` reaches that cluster, every command looks, in order:

  etcd (status, nodes, flush, ...):  --etcd > --state-dir > $KVSTORE_ETCD >
      $KVSTORE_STATE_DIR > .state/cluster/cluster.json in the current directory or the
      nearest parent that has one (up to the repository root, a directory with .git)
  state directory (kvctl cluster ...):  --state-dir > $KVSTORE_STATE_DIR > the same
      search > ./.state/cluster

mTLS: --tls-ca/--tls-cert/--tls-key, else the client pair of the state directory the
etcd endpoints came from (its tls/ when it was started with `cluster up --tls`).

When nothing is found there is no guess: NoCluster says what was looked at and how to
point kvctl at a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from kvstore.config import TLSConfig
from kvstore.devcluster import STATE_FILE, ClusterError, ClusterState

DEFAULT_STATE = ".state/cluster"
ETCD_ENV = "KVSTORE_ETCD"
STATE_ENV = "KVSTORE_STATE_DIR"
HOW_TO_POINT = (
    "start a local cluster here with `make run` or `kvctl cluster up`, or pass "
    "--etcd HOST:PORT[,HOST:PORT] or --state-dir DIR, or set "
    f"${ETCD_ENV} or ${STATE_ENV}"
)


class NoCluster(Exception):
    """No flag, no environment variable, no state directory: nothing to talk to."""


@dataclass(frozen=True, slots=True)
class Found:
    value: str  # etcd endpoints, or a state directory
    source: str  # where it came from, as the user would name it
    tls: TLSConfig | None = None  # a local cluster's client pair (cluster up --tls)


@dataclass(frozen=True, slots=True)
class Search:
    state_dir: Path | None  # the nearest DEFAULT_STATE holding a cluster.json
    looked_in: tuple[Path, ...]  # every directory whose DEFAULT_STATE was checked


def search(start: Path | None = None) -> Search:
    """The nearest DEFAULT_STATE/cluster.json from `start` (the current directory) up to
    the repository root (the first directory with .git) or the filesystem root."""
    here = (start or Path.cwd()).resolve()
    looked: list[Path] = []
    for d in (here, *here.parents):
        looked.append(d)
        if (d / DEFAULT_STATE / STATE_FILE).is_file():
            return Search(d / DEFAULT_STATE, tuple(looked))
        if (d / ".git").exists():
            break
    return Search(None, tuple(looked))


def state_dir(
    flag: str | None,
    env: Mapping[str, str] = os.environ,
    start: Path | None = None,
    look_up: bool = True,
) -> Found:
    """The local cluster's state directory for `kvctl cluster ...` (see the module doc);
    `cluster up` passes look_up=False: it starts a cluster here, not in a parent."""
    if flag:
        return Found(flag, "--state-dir")
    if env.get(STATE_ENV):
        return Found(env[STATE_ENV], f"${STATE_ENV}")
    found = search(start) if look_up else Search(None, ())
    if found.state_dir is not None:
        return Found(str(found.state_dir), f"found from {found.looked_in[0]}")
    looked = ", ".join(str(d) for d in found.looked_in) or "."
    return Found(DEFAULT_STATE, f"default; no {DEFAULT_STATE}/{STATE_FILE} in {looked}")


def _etcd_of(state: str | os.PathLike, source: str) -> Found:
    """Raises ClusterError (with the state directory named) when it holds no cluster."""
    st = ClusterState.load(state)
    return Found(
        st.etcd_endpoint, f"{Path(state).resolve() / STATE_FILE} ({source})", st.client_tls
    )


def etcd(
    etcd_flag: str | None,
    state_flag: str | None,
    env: Mapping[str, str] = os.environ,
    start: Path | None = None,
) -> Found:
    """etcd endpoints for a control command and where they came from (see the module doc).
    Raises ClusterError for a named state directory without a cluster, NoCluster when
    nothing names or holds one."""
    if etcd_flag:
        return Found(etcd_flag, "--etcd")
    if state_flag:
        return _etcd_of(state_flag, "--state-dir")
    if env.get(ETCD_ENV):
        return Found(env[ETCD_ENV], f"${ETCD_ENV}")
    if env.get(STATE_ENV):
        try:
            return _etcd_of(env[STATE_ENV], f"${STATE_ENV}")
        except ClusterError as exc:
            raise ClusterError(f"${STATE_ENV}={env[STATE_ENV]}: {exc}") from None
    found = search(start)
    if found.state_dir is not None:
        return _etcd_of(found.state_dir, f"found from {found.looked_in[0]}")
    looked = ", ".join(str(d) for d in found.looked_in)
    raise NoCluster(
        "no cluster to talk to (none is configured): no --etcd or --state-dir, "
        f"${ETCD_ENV} and ${STATE_ENV} are not set, and no {DEFAULT_STATE}/{STATE_FILE} "
        f"in {looked}.\n  To point kvctl at a cluster: {HOW_TO_POINT}."
    )
