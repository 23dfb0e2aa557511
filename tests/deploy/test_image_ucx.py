"""The image installs the UCX build for the CUDA its torch was built for
(deploy/docker/ucx_requirement.py): a CUDA 13 torch with a CUDA 12 UCX, or no UCX at all,
leaves every peer transfer on the gRPC fallback."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from dockerfile import parse_file

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def _module():
    spec = importlib.util.spec_from_file_location(
        "ucx_requirement", ROOT / "deploy/docker/ucx_requirement.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("major", "wheel"), [("12", "ucxx-cu12"), ("13", "ucxx-cu13")])
def test_a_cuda_torch_gets_the_ucx_built_for_its_cuda(major, wheel):
    ucx = _module()
    reqs = ucx.requirements(PYPROJECT, ucx.extra_for(major))
    assert [r.split("==")[0] for r in reqs] == [wheel]
    assert all(re.fullmatch(r"[\w-]+==[\w.]+", r) for r in reqs)  # pinned, reproducible


def test_a_cpu_torch_gets_the_build_that_runs_without_a_gpu():
    ucx = _module()
    # The same extra `make install` uses on these CPU machines.
    assert ucx.extra_for(None) == "ucx"
    assert "ucx" in (ROOT / "Makefile").read_text().split("pip install -q -e '.[")[1]


def test_an_unknown_cuda_fails_the_build_with_the_fix_named():
    with pytest.raises(SystemExit, match="add a ucx-cu11 extra"):
        _module().extra_for("11")


def test_every_extra_it_names_exists_with_pins_for_one_cuda():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for major, extra in _module().EXTRAS.items():
        cuda = major or "12"
        assert extras[extra], extra
        assert all(re.search(rf"-cu{cuda}==", r) for r in extras[extra]), (extra, major)


def test_the_dockerfile_installs_it_after_torch_and_checks_it():
    cmds = parse_file(str(ROOT / "Dockerfile"))
    froms = [i for i, c in enumerate(cmds) if c.cmd == "FROM"]
    build = cmds[froms[0] : froms[1]]  # the build stage
    runs = [" ".join(c.value) for c in build if c.cmd == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "requirements.txt" in r and "torch" in r)
    ucx_at = next(i for i, r in enumerate(runs) if "ucx_requirement.py" in r)
    assert torch_at < ucx_at  # it reads torch.version.cuda
    copied = [c.value for c in build if c.cmd == "COPY"]
    assert any("deploy/docker/ucx_requirement.py" in v for v in copied)
    assert any("check_install.py" in r for r in runs[ucx_at:])
