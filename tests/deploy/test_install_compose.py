"""scripts/install_compose.sh says what it installs, and why, before it runs apt-get.

Run with a PATH holding only a fake apt-get (which logs its calls and, on install, leaves a fake
docker-compose beside itself), ``id`` and ``chmod``; the script's stderr goes to the same log.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO

FAKE_APT_GET = """#!/bin/sh
echo "apt-get $*" >>"$FAKE_LOG"
if [ "$1" = install ]; then
  printf '#!/bin/sh\\necho 1.29.2\\n' >"${0%/*}/docker-compose"
  chmod +x "${0%/*}/docker-compose"
fi
"""


def test_says_so_before_installing(tmp_path: Path) -> None:
    bash, id_, chmod = shutil.which("bash"), shutil.which("id"), shutil.which("chmod")
    if bash is None or id_ is None or chmod is None:
        pytest.skip("needs bash, id and chmod")
    if subprocess.run([id_, "-u"], capture_output=True, text=True).stdout.strip() != "0":
        pytest.skip("runs sudo when not root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT_GET)
    (bin_dir / "apt-get").chmod(0o755)
    (bin_dir / "id").symlink_to(id_)
    (bin_dir / "chmod").symlink_to(chmod)
    log = tmp_path / "calls.log"
    with log.open("a") as stderr:
        result = subprocess.run(
            [bash, str(REPO / "scripts" / "install_compose.sh")],
            env={"PATH": str(bin_dir), "FAKE_LOG": str(log)},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=30,
        )
    assert result.returncode == 0, log.read_text()
    lines = log.read_text().splitlines()
    assert lines[0].startswith("install_compose.sh: docker-compose not found; installing")
    assert "compose tests" in lines[0]
    assert lines[1:] == [
        "apt-get update -qq",
        "apt-get install -y -qq --no-install-recommends docker-compose",
    ]
    assert result.stdout.strip() == "1.29.2"
