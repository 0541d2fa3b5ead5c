"""Real services for tests: a throw-away PostgreSQL server and Debian's headless Chromium.

`make test` (tests/ensure_services.sh) installs them from Debian's packages when missing. Run
through plain pytest without them, the tests skip saying why; under CI (CI set) they fail.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def require(ok: bool, what: str) -> None:
    if ok:
        return
    message = f"{what} is not installed (make test installs it: tests/ensure_services.sh)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run it as the `postgres` user then."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server on a free loopback port for this test session; stopped afterwards."""
    if os.environ.get("MOETUNE_TEST_PG_URL"):
        yield os.environ["MOETUNE_TEST_PG_URL"]
        return
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    require(bool(initdb and pg_ctl), "PostgreSQL (Debian package postgresql)")
    root = Path(tempfile.mkdtemp(prefix="moetune-pg-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", _free_port()
    subprocess.run(_as_server_user([initdb, "-D", str(data), "-U", "moetune", "--auth=trust", "-E", "UTF8"]),
                   check=True, capture_output=True)
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(_as_server_user([pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start"]),
                   check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg2://moetune@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_server_user([pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def chromium_driver(download_dir: Path | None = None):
    """Selenium on Debian's chromium + chromedriver, headless, with the browser console captured."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver")
    require(Path(browser).exists() and bool(driver), "Chromium (Debian packages chromium, chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1800",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='moetune-chromium-')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager fetch anything
    return webdriver.Chrome(options=opts, service=Service(executable_path=driver))
