"""The images the stack test runs: stand-in base images, then the project's own CPU image.

No image registry is reachable here, so the two images the project pulls are made locally and
tagged under the names docker/Dockerfile and compose.yaml use: `debootstrap` builds a Debian
root file system and `docker import` turns it into an image. The Python base is Debian 12's
Python 3.11 (as in python:3.11-slim) with a virtualenv at /usr/local, so `python`, `pip` and
what pip installs live where the official image has them; the Prometheus is Debian's
`prometheus` package, started as the official image starts it. Each carries a label with a
digest of its recipe: a later run reuses it while the recipe is unchanged.

The project's image is then built from docker/Dockerfile as it is, with one build argument:
torch comes from a wheelhouse made on the host (`pip download`) and served on loopback as a
package index, the usual way to build without its CPU index. The build reaches PyPI through
the host's network.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.docker_engine import CACHE_DIR, INSTALL, Docker, EngineUnavailable, command
from tests.support.server_process import REPO_ROOT

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
SUITE = "bookworm"  # Debian 12, whose python3 is 3.11
SUITE_PYTHON = "3.11"
MIRROR = "http://deb.debian.org/debian"
LABEL = "org.loraserve.stand-in"
# Behind a TLS-inspecting proxy pip must trust the host's CA; Debian's pip reads this bundle.
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# A fixed port when free: the URL is a build argument, and a new one would miss the cache of
# every layer after it.
WHEELHOUSE_PORT = 28731


@dataclass(frozen=True)
class StandIn:
    """A base image made from Debian packages, tagged under the name the project uses."""

    image: str
    packages: tuple[str, ...]
    setup: tuple[tuple[str, ...], ...]  # commands run inside the root file system
    changes: tuple[str, ...]  # Dockerfile instructions `docker import` applies
    host_ca: bool = False  # the host's CA bundle replaces the image's own

    def recipe(self) -> str:
        """A digest of everything that makes the image."""
        digest = hashlib.sha256(repr((self, SUITE, MIRROR)).encode())
        if self.host_ca:
            digest.update(CA_BUNDLE.read_bytes())
        return digest.hexdigest()[:16]


def base_images() -> tuple[str, str]:
    """The Dockerfile's base image and the Prometheus image compose.yaml names."""
    [python] = re.findall(r"^FROM (\S+)", DOCKERFILE.read_text(encoding="utf-8"), re.M)
    [prometheus] = re.findall(r"image: (prom/prometheus:\S+)", compose_text())
    return python, prometheus


def compose_text() -> str:
    return (REPO_ROOT / "compose.yaml").read_text(encoding="utf-8")


def python_stand_in(image: str) -> StandIn:
    if not image.startswith(f"python:{SUITE_PYTHON}"):
        raise AssertionError(f"the stand-in for {image} is Debian {SUITE}'s Python {SUITE_PYTHON}")
    return StandIn(
        image,
        packages=("python3", "python3-venv", "ca-certificates"),
        setup=(("python3", "-m", "venv", "/usr/local"),),
        changes=("ENV LANG=C.UTF-8", 'CMD ["python3"]'),
        host_ca=True,
    )


def prometheus_stand_in(image: str) -> StandIn:
    return StandIn(
        image,
        packages=("prometheus",),
        setup=(("install", "-d", "-o", "nobody", "-g", "nogroup", "/prometheus"),),
        changes=(
            "USER nobody",
            "WORKDIR /prometheus",
            "EXPOSE 9090",
            'VOLUME ["/prometheus"]',
            'ENTRYPOINT ["/bin/prometheus"]',
            'CMD ["--config.file=/etc/prometheus/prometheus.yml",'
            ' "--storage.tsdb.path=/prometheus"]',
        ),
    )


def ensure_stand_in(docker: Docker, stand_in: StandIn) -> str:
    """Makes the image unless this recipe's is there; says what it did."""
    found = docker.run(
        "image",
        "inspect",
        "-f",
        f'{{{{index .Config.Labels "{LABEL}"}}}}',
        stand_in.image,
        check=False,
    )
    label = found.stdout.strip()
    if found.returncode == 0 and label == stand_in.recipe():
        return "cached"
    if found.returncode == 0 and label in ("", "<no value>"):
        return "found, not a stand-in: used as it is"
    started = time.monotonic()
    make_stand_in(docker, stand_in)
    return f"made in {time.monotonic() - started:.0f} s"


def make_stand_in(docker: Docker, stand_in: StandIn) -> None:
    for tool in ("debootstrap", "chroot", "tar"):
        if shutil.which(tool) is None:
            raise EngineUnavailable(f"{tool} is not installed: {INSTALL}")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix="rootfs-") as scratch:
        root = Path(scratch) / "root"
        try:
            packages = ",".join(stand_in.packages)
            command(
                "debootstrap",
                "--variant=minbase",
                f"--include={packages}",
                SUITE,
                str(root),
                MIRROR,
                timeout=1200,
            )
            if stand_in.host_ca:  # after the ca-certificates package wrote its own bundle
                shutil.copyfile(CA_BUNDLE, root / CA_BUNDLE.relative_to("/"))
            for step in stand_in.setup:
                command("chroot", str(root), *step)
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (root / leftover).glob("*"):
                    if path.is_file():
                        path.unlink()
            archive = Path(scratch) / "root.tar"
            command("tar", "-C", str(root), "-cf", str(archive), ".")
            changes = [*stand_in.changes, f"LABEL {LABEL}={stand_in.recipe()}"]
            flags = [flag for change in changes for flag in ("--change", change)]
            docker("import", *flags, str(archive), stand_in.image, timeout=600)
        finally:
            unmount_below(root)  # a failed debootstrap can leave /proc mounted in the root


def unmount_below(root: Path) -> None:
    """Unmounts whatever is mounted inside `root`, so removing it cannot reach the host."""
    mounts = Path("/proc/mounts").read_text(encoding="utf-8").splitlines()
    inside = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{root}/")]
    for mountpoint in sorted(inside, reverse=True):
        subprocess.run(["umount", "-l", mountpoint], check=False)


# --- torch from a wheelhouse -----------------------------------------------------------------


def torch_requirement() -> str:
    """The torch pin the Dockerfile installs, e.g. torch==2.13.0."""
    [pin] = re.findall(r"\btorch==[\w.+]+", DOCKERFILE.read_text(encoding="utf-8"))
    return pin


def torch_wheelhouse() -> Path:
    """torch's CPU wheel and its dependencies for the image's Python, laid out as a package
    index (a folder per project, as pip's --index-url reads it); made once."""
    pin = torch_requirement()
    folder = CACHE_DIR / f"wheelhouse-{pin.replace('==', '-')}-cp{SUITE_PYTHON.replace('.', '')}"
    if any(folder.glob("torch/torch-*+cpu-*.whl")):
        return folder
    download = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(download, ignore_errors=True)
    command(
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--python-version",
        SUITE_PYTHON,
        "--platform",
        "manylinux_2_28_x86_64",
        "--dest",
        str(download),
        pin,
        timeout=1200,
    )
    wheels = sorted(download.glob("*.whl"))
    if not any(w.name.startswith("torch-") and "+cpu" in w.name for w in wheels):
        raise AssertionError(
            f"pip found no CPU build of {pin} (it downloaded {[w.name for w in wheels]}); "
            "point it at the CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
        )
    for wheel in wheels:  # a wheel's name starts with its project's, `_` for `-`
        project = download / re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        project.mkdir(exist_ok=True)
        wheel.rename(project / wheel.name)
    shutil.rmtree(folder, ignore_errors=True)
    download.rename(folder)
    return folder


@contextmanager
def served_folder(folder: Path) -> Iterator[str]:
    """The folder served over HTTP on loopback (its listings are an index's pages); yields
    its URL."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = partial(Quiet, directory=str(folder))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), handler)
    except OSError:  # taken: any port, at the cost of a rebuild
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


# --- the project's image ---------------------------------------------------------------------


@dataclass(frozen=True)
class Build:
    """How the project's image build went."""

    seconds: float
    steps: int
    cached_steps: int
    size_bytes: int


def build_image(docker: Docker, image: str, wheelhouse_url: str) -> Build:
    """docker/Dockerfile built as it is, torch from the wheelhouse; older builds removed."""
    started = time.monotonic()
    output = docker(
        "build",
        "--network",
        "host",
        "--file",
        str(DOCKERFILE),
        "--build-arg",
        f"TORCH_INDEX={wheelhouse_url}",
        "--tag",
        image,
        str(REPO_ROOT),
        timeout=1800,
    )
    seconds = time.monotonic() - started
    # Earlier builds of the image, untagged by this one; only images made from a stand-in.
    docker("image", "prune", "--force", "--filter", f"label={LABEL}")
    return Build(
        seconds=seconds,
        steps=len(re.findall(r"^Step \d+/\d+", output, re.M)),
        cached_steps=output.count("Using cache"),
        size_bytes=int(docker("image", "inspect", "--format", "{{.Size}}", image)),
    )
