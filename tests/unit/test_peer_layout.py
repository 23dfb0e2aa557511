"""The shape of node_agent/peer/, checked (STYLE 17, 20): no import cycle in node_agent,
not even one hidden behind TYPE_CHECKING or a function-local import; every transport
implements the one Transport interface, and the transport-agnostic modules never name a
transport; files stay small. Static: the source is parsed, nothing is started."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "node_agent"
PEER = AGENT / "peer"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in AGENT.rglob("*.py")}


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """node_agent modules a module imports, wherever the import statement sits."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names} & known
    return out


def test_node_agent_has_no_import_cycle():
    mods = modules()
    graph = {name: imported(tree, set(mods)) - {name} for name, tree in mods.items()}
    cycles = []

    def visit(name: str, path: list[str], done: set[str]) -> None:
        if name in path:
            cycles.append(" -> ".join(path[path.index(name) :] + [name]))
            return
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name], done)
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [], done)
    assert not cycles, cycles


def test_peer_package_imports_at_module_level_only():
    """No TYPE_CHECKING blocks, no function-local imports of node_agent modules (the ways
    a cycle hides). ucxx, an optional dependency, may be imported where it is used."""
    found = []
    for name, tree in modules().items():
        if not name.startswith("node_agent.peer"):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("node_agent", "kvstore", "cluster")
                ):
                    found.append(f"{name}.{fn.name} imports {node.module}")
        if any(isinstance(n, ast.Name) and n.id == "TYPE_CHECKING" for n in ast.walk(tree)):
            found.append(f"{name} uses TYPE_CHECKING")
    assert not found, found


def test_every_transport_implements_the_interface():
    from node_agent.peer.grpc_transport import GrpcTransport
    from node_agent.peer.transport import Transport
    from node_agent.peer.ucx.transport import UcxTransport

    wanted = [
        n for n, v in vars(Transport).items() if inspect.isfunction(v) and not n.startswith("_")
    ]
    assert set(wanted) == {"address_of", "chunk_blocks", "fetch", "close"}
    for cls in (UcxTransport, GrpcTransport):
        for name in wanted:
            assert inspect.signature(getattr(cls, name)) == inspect.signature(
                getattr(Transport, name)
            ), (cls.__name__, name)
            assert inspect.iscoroutinefunction(getattr(cls, name)) == inspect.iscoroutinefunction(
                getattr(Transport, name)
            ), (cls.__name__, name)
    assert {UcxTransport.name, GrpcTransport.name} == {"ucx", "grpc"}


@pytest.mark.parametrize(
    "module", ["prefetch", "claims", "sink", "serve", "requests", "transport", "staging"]
)
def test_transport_agnostic_modules_never_name_a_transport(module):
    """The caller picks a transport object; it never branches on a transport's name."""
    tree = ast.parse((PEER / f"{module}.py").read_text())
    names = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in ("ucx", "grpc")
    ]
    imports = [
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and (n.module or "").startswith(("node_agent.peer.ucx", "node_agent.peer.grpc_transport"))
    ]
    assert not names and not imports, (names, imports)


def test_peer_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PEER.rglob("*.py")}
    assert sizes and max(sizes.values()) <= 600, sizes
