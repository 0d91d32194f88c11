"""Build and cache the guest of the ``microvm`` sandbox tier: a kernel and a base initramfs.

The guest is made of parts of this (Debian) host, nothing is downloaded but Debian packages:

* ``vmlinux``: the uncompressed kernel of Debian's ``linux-image-cloud-amd64``
  (``apt-get download`` + ``dpkg -x``; the lz4 payload of the bzImage is decompressed with
  ``lz4`` so that the guest does not spend boot time decompressing itself);
* ``initramfs.cpio``: an uncompressed newc archive holding ``busybox`` (from ``busybox-static``),
  the host's ``python3`` with the shared libraries it needs (per ``ldd``) and a minimal,
  precompiled standard library (enough for the in-guest runner and for typical handlers).

Per-job content (the runner, handlers, workspace, job description) is *not* in the image: it is
a second archive appended at every boot (see :mod:`fleetless.sandbox.microvm`), so the image is
built once per host, with ``fleetless microvm build-image`` or
``python -m fleetless.sandbox.microvm_image``.

Handlers may need more than busybox and the standard library: ``build-image --apt bash --pip
requests`` adds Debian packages (their files, plus the host's copies of the shared libraries
they link, per ``ldd``; dependencies are not followed, name them too) and Python requirements
(``pip install --target`` into the guest's ``dist-packages``, plus the standard-library modules
they import). Such an image has a cache directory of its own, ``extras-<hash>`` beside the
default image, which it leaves alone; drains use it with ``FLEETLESS_CACHE=<that directory>``.

Host packages needed: ``qemu-system-x86 busybox-static lz4`` and a ``python3`` at
``/usr/bin/python3`` (run ``apt-get update`` once so that ``apt-get download`` finds the kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetless.sandbox import SandboxUnavailable

__all__ = [
    "IMAGE_FORMAT",
    "CpioWriter",
    "Extras",
    "ImageInfo",
    "build_image",
    "build_snapshots",
    "default_cache_dir",
    "extras_cache_dir",
    "guest_has_program",
    "load_image",
]

#: Bumped whenever the layout of the image changes; an older cached image is rebuilt.
IMAGE_FORMAT = 1

KERNEL_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX = "/bin/busybox"
HOST_PYTHON = "/usr/bin/python3"
LZ4_MAGIC = b"\x02\x21\x4c\x18"  # lz4 "legacy" frame, as the kernel's bzImage uses
#: Modules (in load order) for a virtio-mmio network device, loaded only for network jobs.
NET_MODULES = (
    "drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko", "drivers/virtio/virtio_mmio.ko",
    "net/core/failover.ko", "drivers/net/net_failover.ko", "drivers/net/virtio_net.ko",
)
#: Where they are in the guest.
GUEST_MODULES = "lib/modules/fleetless"

#: Modules the guest python must be able to import (their imports come along).
STDLIB_SEEDS = (
    "site", "__future__", "gettext", "json", "os", "sys", "re", "base64", "binascii",
    "subprocess", "signal", "selectors", "select", "time", "datetime", "calendar", "math",
    "cmath", "random", "hashlib", "hmac", "secrets", "collections", "collections.abc",
    "itertools", "functools", "operator", "pathlib", "shutil", "tempfile", "glob", "fnmatch",
    "io", "struct", "string", "textwrap", "typing", "dataclasses", "enum", "decimal",
    "fractions", "numbers", "statistics", "uuid", "copy", "pprint", "heapq", "bisect",
    "traceback", "logging", "argparse", "csv", "gzip", "zlib", "zipfile", "tarfile",
    "urllib.parse", "html", "html.parser", "unicodedata", "contextlib", "abc", "types",
    "weakref", "warnings", "locale", "codecs", "encodings.idna", "encodings.latin_1",
    "encodings.ascii", "encodings.utf_16", "encodings.utf_32", "encodings.cp1252",
    "encodings.unicode_escape", "encodings.raw_unicode_escape", "resource", "termios", "errno",
    "stat", "platform", "getopt", "shlex", "queue", "threading", "concurrent.futures", "array",
    "socket", "ipaddress", "difflib", "graphlib", "zoneinfo", "xml.etree.ElementTree", "pickle",
    "copyreg", "lzma", "bz2", "mimetypes", "email.message", "email.utils", "quopri", "inspect",
    "ast", "dis", "tokenize", "contextvars", "asyncio",
)
#: Never copied: large, or pull in libraries the guest has no use for (TLS: no network).
STDLIB_EXCLUDE = re.compile(r"^(_ssl|ssl|_hashlib|_tkinter|tkinter|idlelib|test|lib2to3|ensurepip"
                            r"|_ctypes_test|_test.*|xxlimited.*|turtle.*|pydoc_data|pydoc|doctest|unittest|sqlite3"
                            r"|_sqlite3|multiprocessing|_multiprocessing)$")

_COLLECT_SCRIPT = r"""
import importlib, json, sys, sysconfig
seeds = json.loads(sys.argv[1])
sys.path[1:1] = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
failed = []
for name in seeds:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {exc}")
files = {}
for name, mod in sorted(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if f:
        files[name] = [f, hasattr(mod, "__path__")]
print(json.dumps({"files": files, "failed": failed, "stdlib": sysconfig.get_path("stdlib"),
                  "platstdlib": sysconfig.get_path("platstdlib"), "version": sys.version,
                  "executable": sys.executable, "dynload": sysconfig.get_path("platstdlib")
                  + "/lib-dynload"}))
"""

_COMPILE_SCRIPT = r"""
import json, py_compile, sys
for src, dst, name in json.loads(sys.stdin.read()):
    py_compile.compile(src, cfile=dst, dfile=name, doraise=True, optimize=0,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
"""


def default_cache_dir() -> Path:
    """``$FLEETLESS_CACHE`` (the microvm image directly in it) or ``~/.cache/fleetless/microvm``."""
    env = os.environ.get("FLEETLESS_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "fleetless" / "microvm"


#: Where pip puts requirements in the guest: the first of the guest python's site directories.
GUEST_SITE_PACKAGES = "usr/local/lib/{python}/dist-packages"


@dataclass(frozen=True)
class Extras:
    """What an image holds beyond busybox and the standard library."""

    apt: tuple[str, ...] = ()  # Debian packages, by name
    pip: tuple[str, ...] = ()  # Python requirements, as pip takes them

    def __bool__(self) -> bool:
        return bool(self.apt or self.pip)

    def key(self) -> str:
        text = json.dumps({"format": IMAGE_FORMAT, "apt": sorted(set(self.apt)), "pip": sorted(set(self.pip))})
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def extras_cache_dir(extras: Extras, base: Path | None = None) -> Path:
    """The directory of an image with ``extras``: beside the default image, never the same one."""
    return (base or default_cache_dir()) / f"extras-{extras.key()}"


@dataclass(frozen=True)
class ImageInfo:
    """A built guest: where its parts are and what is in it."""

    directory: Path
    kernel: Path
    initramfs: Path
    manifest: dict[str, object]


def load_image(cache_dir: Path | None = None) -> ImageInfo:
    """The cached image, or :class:`SandboxUnavailable` saying how to build it."""
    directory = cache_dir or default_cache_dir()
    manifest_path = directory / "manifest.json"
    hint = "run `fleetless microvm build-image`"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        raise SandboxUnavailable(f"microvm image not built: {hint} (looked in {directory})") from None
    if manifest.get("format") != IMAGE_FORMAT:
        raise SandboxUnavailable(f"microvm image in {directory} is outdated: {hint}")
    kernel = directory / "vmlinux"
    initramfs = directory / "initramfs.cpio"
    if not (kernel.is_file() and initramfs.is_file()):
        raise SandboxUnavailable(f"microvm image in {directory} is incomplete: {hint}")
    return ImageInfo(directory, kernel, initramfs, manifest)


_entries_cache: dict[str, tuple[dict[str, int], dict[str, str]]] = {}


def _entries(image: ImageInfo) -> tuple[dict[str, int], dict[str, str]]:
    """(mode of every path, target of every symlink) in the image's initramfs, read once per
    process and image."""
    key = str(image.manifest.get("initramfs_sha256") or image.initramfs)
    cached = _entries_cache.get(key)
    if cached is not None:
        return cached
    modes: dict[str, int] = {}
    links: dict[str, str] = {}
    for name, mode, body in read_cpio(image.initramfs.read_bytes()):
        modes[name] = mode
        if stat.S_ISLNK(mode):
            links[name] = bytes(body).decode(errors="replace")
    _entries_cache[key] = (modes, links)
    return modes, links


def read_cpio(data: bytes) -> Iterator[tuple[str, int, memoryview]]:
    """(absolute path, mode, content) of each entry of a newc archive, up to its trailer."""
    view = memoryview(data)
    pos = 0
    while data[pos:pos + 6] == b"070701":
        mode, size, namesize = (int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in (1, 6, 11))
        name_end = pos + 110 + namesize
        name = "/" + data[pos + 110: name_end - 1].decode(errors="replace").strip("/")
        body = (name_end + 3) & ~3
        if name == "/TRAILER!!!":
            return
        yield name, mode, view[body: body + size]
        pos = (body + size + 3) & ~3


def guest_has_program(image: ImageInfo, path: str) -> bool:
    """Whether ``path`` (absolute) is, in the guest, an executable file or a symlink that resolves
    to one: what a handler's shebang or ``--python`` can name."""
    modes, links = _entries(image)
    parts = [p for p in os.path.normpath(path).split("/") if p]
    current = ""
    hops = 0
    while parts:
        current = f"{current}/{parts.pop(0)}"
        if current in links:
            hops += 1
            if hops > 40:
                return False
            target = links[current]
            base = "/" if target.startswith("/") else os.path.dirname(current)
            parts = [p for p in os.path.normpath(os.path.join(base, target)).split("/") if p] + parts
            current = ""
    mode = modes.get(current)
    return mode is not None and stat.S_ISREG(mode) and bool(mode & 0o111)


# --------------------------------------------------------------------------- cpio (newc) writer


class CpioWriter:
    """Writes a newc ("070701") cpio archive, the format the kernel unpacks as initramfs."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._ino = 1000
        self._seen: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", uid: int = 0, gid: int = 0,
               nlink: int = 1, rdev: tuple[int, int] = (0, 0)) -> None:
        name = name.strip("/")
        if name in self._seen:
            return
        self._seen.add(name)
        self._ino += 1
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, uid, gid, nlink, 0, len(data), 0, 0, rdev[0], rdev[1],
                  len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self._add(header + encoded)
        self._pad()
        if data:
            self._add(data)
            self._pad()

    def _add(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)

    def _pad(self) -> None:
        if self._size % 4:
            self._add(b"\0" * (4 - self._size % 4))

    def dir(self, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        """A directory (its parents must have been added first, or exist in an earlier archive)."""
        self._entry(name, stat.S_IFDIR | mode, uid=uid, gid=gid, nlink=2)

    def dirs(self, name: str, mode: int = 0o755) -> None:
        """``name`` and all its parents, root-owned."""
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            self.dir("/".join(parts[:i]), mode)

    def file(self, name: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
        self._entry(name, stat.S_IFREG | mode, data, uid=uid, gid=gid)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def tree(self, src: Path, dest: str, *, dir_mode: int = 0o555, file_mode: int = 0o444,
             exec_mode: int = 0o555, uid: int = 0, gid: int = 0) -> None:
        """Copy a host directory (regular files, directories, symlinks as they are)."""
        self.dir(dest, dir_mode, uid, gid)
        for root, dirnames, filenames in os.walk(src):
            dirnames.sort()
            rel = os.path.relpath(root, src)
            base = dest if rel == "." else f"{dest}/{rel}"
            for d in list(dirnames):
                p = Path(root, d)
                if p.is_symlink():
                    self.symlink(f"{base}/{d}", os.readlink(p))
                    dirnames.remove(d)
                else:
                    self.dir(f"{base}/{d}", dir_mode, uid, gid)
            for f in sorted(filenames):
                p = Path(root, f)
                st = p.lstat()
                if stat.S_ISLNK(st.st_mode):
                    self.symlink(f"{base}/{f}", os.readlink(p))
                elif stat.S_ISREG(st.st_mode):
                    mode = exec_mode if st.st_mode & 0o111 else file_mode
                    self.file(f"{base}/{f}", p.read_bytes(), mode, uid, gid)

    def finish(self) -> bytes:
        """The archive with its trailer, padded to 4 bytes (so another one can follow)."""
        self._entry("TRAILER!!!", 0)
        self._seen.discard("TRAILER!!!")
        self._pad()
        data = b"".join(self._chunks)
        return data


# --------------------------------------------------------------------------- building


def _run(argv: list[str], cwd: Path | None = None, what: str = "") -> str:
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise SandboxUnavailable(f"cannot build the microvm image: {argv[0]} not found"
                                 f"{what}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SandboxUnavailable(f"cannot build the microvm image: `{' '.join(argv)}` failed"
                                 f"{what}: {' | '.join(tail)}")
    return proc.stdout


def _require_tools() -> None:
    missing = []
    for tool, package in (("apt-get", "apt"), ("dpkg", "dpkg"), ("lz4", "lz4")):
        if shutil.which(tool) is None:
            missing.append(package)
    if not os.access(BUSYBOX, os.X_OK):
        missing.append("busybox-static")
    if not os.access(HOST_PYTHON, os.X_OK):
        missing.append("python3")
    if missing:
        raise SandboxUnavailable("cannot build the microvm image: missing host packages: "
                                 f"apt-get install -y {' '.join(missing)}")
    out = _run(["file", "-L", BUSYBOX]) if shutil.which("file") else "statically linked"
    if "statically linked" not in out and "static-pie" not in out:
        raise SandboxUnavailable(f"cannot build the microvm image: {BUSYBOX} is not static: "
                                 "apt-get install -y busybox-static")


def _fetch_kernel(work: Path) -> tuple[bytes, str]:
    """Download the cloud kernel package, return (uncompressed vmlinux, package version)."""
    hint = " (run `apt-get update` first?)"
    _run(["apt-get", "download", "-q", KERNEL_PACKAGE], cwd=work, what=hint)
    meta = next(work.glob(f"{KERNEL_PACKAGE}_*.deb"))
    depends = _run(["dpkg-deb", "-f", str(meta), "Depends"])
    match = re.search(r"(linux-image-[0-9][^\s,(]*)", depends)
    if not match:
        raise SandboxUnavailable(f"cannot build the microvm image: no kernel in {meta.name} "
                                 f"Depends: {depends.strip()}")
    package = match.group(1)
    _run(["apt-get", "download", "-q", package], cwd=work, what=hint)
    deb = next(work.glob(f"{package}_*.deb"))
    root = work / "kernel"
    _run(["dpkg", "-x", str(deb), str(root)])
    vmlinuz = next((root / "boot").glob("vmlinuz-*"))
    compressed = vmlinuz.read_bytes()
    offset = compressed.find(LZ4_MAGIC)
    if offset < 0:
        raise SandboxUnavailable(f"cannot build the microvm image: {vmlinuz.name} is not "
                                 "lz4-compressed (no lz4 magic found)")
    proc = subprocess.run(["lz4", "-dc"], input=compressed[offset:], capture_output=True,
                          check=False)
    # lz4 complains about the bytes trailing the compressed kernel; the output is complete.
    vmlinux = proc.stdout
    if not vmlinux.startswith(b"\x7fELF"):
        raise SandboxUnavailable("cannot build the microvm image: lz4 did not yield an ELF "
                                 f"kernel: {proc.stderr.decode(errors='replace').strip()}")
    modules = next((root / "lib" / "modules").iterdir()) / "kernel"
    for rel in NET_MODULES:
        (work / "modules").mkdir(exist_ok=True)
        shutil.copyfile(modules / rel, work / "modules" / os.path.basename(rel))
    return vmlinux, deb.name


def _kernel_of(image: ImageInfo, work: Path) -> tuple[bytes, str]:
    """The kernel (and its NET_MODULES, into ``work/modules``) of an image already built here, so
    that an image with extras needs no second download of the same kernel."""
    wanted = {f"/{GUEST_MODULES}/{os.path.basename(rel)}" for rel in NET_MODULES}
    (work / "modules").mkdir(exist_ok=True)
    for name, _mode, body in read_cpio(image.initramfs.read_bytes()):
        if name in wanted:
            (work / "modules" / os.path.basename(name)).write_bytes(body)
            wanted.discard(name)
    if wanted:
        raise SandboxUnavailable(f"microvm image in {image.directory} lacks {sorted(wanted)[0]}")
    return image.kernel.read_bytes(), str(image.manifest.get("kernel_package", ""))


def _ldd(paths: Iterable[str]) -> set[str]:
    """The shared libraries (and the loader) that ``paths`` need, as absolute host paths."""
    libs: set[str] = set()
    for p in paths:
        proc = subprocess.run(["ldd", p], capture_output=True, text=True, check=False)
        for line in proc.stdout.splitlines():
            m = re.search(r"(/\S+)\s+\(0x", line)
            if m:
                libs.add(m.group(1))
    return libs


def _add_host_file(cpio: CpioWriter, path: str, mode: int | None = None) -> int:
    """Copy a host file to the same path in the guest, symlinks resolved but kept as links."""
    p = Path(path)
    cpio.dirs(str(p.parent))
    if p.is_symlink():
        target = os.readlink(p)
        cpio.symlink(path, target)
        resolved = target if target.startswith("/") else str(p.parent / target)
        return _add_host_file(cpio, os.path.normpath(resolved), mode)
    data = p.read_bytes()
    cpio.file(path, data, mode if mode is not None else stat.S_IMODE(p.stat().st_mode))
    return len(data)


def _add_python(cpio: CpioWriter, work: Path, extra_seeds: Iterable[str] = (),
                extra_path: Iterable[str] = ()) -> dict[str, object]:
    exe = os.path.realpath(HOST_PYTHON)
    seeds = [*STDLIB_SEEDS, *extra_seeds]
    out = _run([exe, "-E", "-s", "-c", _COLLECT_SCRIPT, json.dumps(seeds), json.dumps(list(extra_path))])
    info = json.loads(out)
    stdlib: str = info["stdlib"]
    dynload: str = info["dynload"]
    sources: list[tuple[str, str, str]] = []  # (src, dst in work, name in guest)
    extensions: list[str] = []
    for name, (path, _is_pkg) in info["files"].items():
        top = name.split(".")[0]
        if STDLIB_EXCLUDE.match(top) or STDLIB_EXCLUDE.match(name):
            continue
        if not path.startswith(stdlib + "/"):
            continue  # site-packages / dist-packages: not part of the guest
        if path.endswith(".py"):
            rel = os.path.relpath(path, stdlib)
            sources.append((path, str(work / "pyc" / (rel + "c")), path))
        elif path.endswith(".so"):
            extensions.append(path)
    proc = subprocess.run([exe, "-E", "-s", "-c", _COMPILE_SCRIPT], input=json.dumps(sources),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxUnavailable(f"cannot build the microvm image: compiling the stdlib failed: "
                                 f"{proc.stderr.strip().splitlines()[-1:]}")
    # The interpreter, its links and libraries.
    size = _add_host_file(cpio, exe, 0o755)
    version = os.path.basename(exe)  # python3.11
    cpio.symlink("usr/bin/python3", version)
    cpio.symlink("usr/bin/python", version)
    for lib in sorted(_ldd([exe, *extensions])):
        size += _add_host_file(cpio, lib)
    # The stdlib, sourceless: foo.pyc where foo.py was (the import system loads those).
    cpio.dirs(stdlib)
    cpio.dirs(dynload)
    for _src, dst, guest in sorted(sources, key=lambda s: s[2]):
        rel = os.path.relpath(guest, stdlib)
        cpio.dirs(os.path.dirname(f"{stdlib}/{rel}"))
        data = Path(dst).read_bytes()
        cpio.file(f"{stdlib}/{rel}c", data, 0o644)
        size += len(data)
    for so in sorted(extensions):
        size += _add_host_file(cpio, so, 0o644)
    # getpath's landmark for the prefix is lib/pythonX.Y/os.py(c): present.
    return {"python": version, "python_version": info["version"].split()[0],
            "python_bytes": size, "stdlib_modules": len(sources),
            "extension_modules": len(extensions), "import_failures": info["failed"]}


def _add_busybox(cpio: CpioWriter) -> list[str]:
    cpio.dirs("bin")
    _add_host_file(cpio, BUSYBOX, 0o755)
    applets = _run([BUSYBOX, "--list-full"]).split()
    for applet in applets:
        path = "/" + applet.strip("/")
        if path == BUSYBOX:
            continue
        cpio.dirs(os.path.dirname(path))
        cpio.symlink(path, BUSYBOX)
    return applets


def _elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _add_debs(cpio: CpioWriter, work: Path, packages: Sequence[str]) -> dict[str, object]:
    """The named Debian packages' files, at their paths, plus the host's copies of the shared
    libraries their programs link (``ldd``); ``/bin/x`` links for a package's ``/usr/bin/x``
    (and sbin) so shebangs of either form work, as on a merged-/usr host."""
    debs = work / "debs"
    debs.mkdir()
    os.chmod(debs, 0o755)  # apt's _apt user downloads into it where it can
    names = [p for p in packages if not p.endswith(".deb")]
    for local in (p for p in packages if p.endswith(".deb")):  # a .deb file of your own
        shutil.copyfile(local, debs / os.path.basename(local))
    if names:
        _run(["apt-get", "download", "-q", *names], cwd=debs,
             what=" (a Debian package name? run `apt-get update`?)")
    root = work / "apt-root"
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg", "-x", str(deb), str(root)])
    elves: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        guest_dir = "" if rel == "." else rel
        if guest_dir:
            cpio.dirs(guest_dir)
        for name in sorted(dirnames):
            if os.path.islink(os.path.join(dirpath, name)):
                cpio.symlink(f"{guest_dir}/{name}".strip("/"), os.readlink(os.path.join(dirpath, name)))
        for name in sorted(filenames):
            host = Path(dirpath, name)
            guest = f"{guest_dir}/{name}".strip("/")
            st = host.lstat()
            if stat.S_ISLNK(st.st_mode):
                cpio.symlink(guest, os.readlink(host))
            elif stat.S_ISREG(st.st_mode):
                cpio.file(guest, host.read_bytes(), stat.S_IMODE(st.st_mode) & 0o755)
                if _elf(host):
                    elves.append(str(host))
    for usr_dir, top in (("usr/bin", "bin"), ("usr/sbin", "sbin")):
        for program in sorted((root / usr_dir).glob("*")) if (root / usr_dir).is_dir() else []:
            cpio.symlink(f"{top}/{program.name}", f"/{usr_dir}/{program.name}")
    missing = set()
    for elf in elves:
        proc = subprocess.run(["ldd", elf], capture_output=True, text=True, check=False)
        missing |= {line.split()[0] for line in proc.stdout.splitlines() if "not found" in line}
    if missing:
        raise SandboxUnavailable("cannot build the microvm image: the packages' programs need libraries "
                                 f"this host does not have: {', '.join(sorted(missing))} (add their packages "
                                 "with --apt)")
    for lib in sorted(_ldd(elves)):
        _add_host_file(cpio, lib)
    return {"apt": list(packages), "apt_debs": sorted(d.name for d in debs.glob("*.deb"))}


def _pip_install(work: Path, requirements: Sequence[str]) -> tuple[Path, list[str]]:
    """``pip install --target`` for the guest's python; returns the directory and the top-level
    import names it now holds."""
    target = work / "site"
    guest_version = _run([HOST_PYTHON, "-c", "import sys; print(*sys.version_info[:2], sep='.')"]).strip()
    argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input",
            "--target", str(target), "--no-warn-script-location"]
    if guest_version != f"{sys.version_info[0]}.{sys.version_info[1]}":
        argv += ["--python-version", guest_version, "--only-binary=:all:"]
    _run([*argv, "--", *requirements], what=" (a requirement pip can install?)")
    names = set()
    for entry in target.iterdir():
        if entry.name.endswith((".dist-info", ".egg-info")) or entry.name in ("bin", "__pycache__"):
            continue
        if entry.is_dir() and ((entry / "__init__.py").exists() or any(entry.glob("*.py"))):
            names.add(entry.name)
        elif entry.suffix == ".py" or entry.name.endswith(".so"):
            names.add(entry.name.split(".")[0])
    return target, sorted(names)


def _base_initramfs(work: Path, extras: Extras = Extras()) -> tuple[bytes, dict[str, object]]:
    cpio = CpioWriter()
    for d in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "lib", "etc", "proc", "sys", "dev",
              "run", "var", "fleetless"):
        cpio.dir(d, 0o755)
    cpio.dir("root", 0o700)
    cpio.dir("tmp", 0o1777)
    cpio.chardev("dev/console", 5, 1, 0o600)
    cpio.chardev("dev/null", 1, 3, 0o666)
    cpio.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"
                            b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    cpio.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    cpio.file("etc/hostname", b"fleetless\n")
    cpio.file("etc/hosts", b"127.0.0.1 localhost fleetless\n::1 localhost\n")
    cpio.dirs(GUEST_MODULES)
    for rel in NET_MODULES:
        name = os.path.basename(rel)
        cpio.file(f"{GUEST_MODULES}/{name}", (work / "modules" / name).read_bytes(), 0o600)
    added: dict[str, object] = {}
    if extras.apt:  # before busybox: a package's program wins over the applet of that name
        added.update(_add_debs(cpio, work, extras.apt))
    applets = _add_busybox(cpio)
    site: Path | None = None
    modules: list[str] = []
    if extras.pip:
        site, modules = _pip_install(work, extras.pip)
    python = _add_python(cpio, work, modules, [str(site)] if site else [])
    if site is not None:
        guest_site = GUEST_SITE_PACKAGES.format(python=python["python"])
        cpio.dirs(guest_site)
        cpio.tree(site, guest_site)
        added.update({"pip": list(extras.pip), "pip_modules": modules})
    return cpio.finish(), {"busybox_applets": len(applets), **python, **added}


def build_image(cache_dir: Path | None = None, force: bool = False, extras: Extras = Extras()) -> Path:
    """Build the guest (kernel + base initramfs) into ``cache_dir``; returns that directory.

    With ``extras``, the directory defaults to :func:`extras_cache_dir` (not the default image's).
    Does nothing when an image of the current format is there already, unless ``force``.
    Raises :class:`SandboxUnavailable` with a one-line reason when a host tool is missing.
    """
    directory = cache_dir or (extras_cache_dir(extras) if extras else default_cache_dir())
    if not force:
        try:
            load_image(directory)
            return directory
        except SandboxUnavailable:
            pass
    _require_tools()
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleetless-image-", dir=directory) as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # apt's _apt user downloads into it where it can
        kernel: tuple[bytes, str] | None = None
        if extras:  # an image with extras takes the default image's kernel when there is one
            with contextlib.suppress(SandboxUnavailable):
                kernel = _kernel_of(load_image(), work)
        vmlinux, kernel_deb = kernel or _fetch_kernel(work)  # both leave NET_MODULES in work/modules
        initramfs, contents = _base_initramfs(work, extras)
        (work / "vmlinux").write_bytes(vmlinux)
        (work / "initramfs.cpio").write_bytes(initramfs)
        manifest: dict[str, object] = {
            "format": IMAGE_FORMAT,
            "kernel_package": kernel_deb,
            "kernel_bytes": len(vmlinux),
            "initramfs_bytes": len(initramfs),
            "initramfs_sha256": hashlib.sha256(initramfs).hexdigest(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": 0.0,
            **contents,
        }
        manifest["build_seconds"] = round(time.monotonic() - started, 1)
        # Kernel and initramfs first, the manifest (which marks the image as built) last.
        os.replace(work / "vmlinux", directory / "vmlinux")
        os.replace(work / "initramfs.cpio", directory / "initramfs.cpio")
        tmp_manifest = work / "manifest.json"
        tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp_manifest, directory / "manifest.json")
    for stale in directory.glob("accel*.json"):
        stale.unlink(missing_ok=True)  # the KVM probe is redone against the new image
    return directory


def build_snapshots(directory: Path, shapes: Sequence[tuple[int, int]] = ((512, 1),)) -> list[Path]:
    """A snapshot of the image in ``directory`` for each (RAM MiB, vCPUs) shape (see
    :mod:`fleetless.sandbox.microvm.snapshot`); those already current are left as they are."""
    from fleetless.sandbox.microvm.snapshot import build_snapshot

    image = load_image(directory)
    return [build_snapshot(image, memory_mib, cpus) for memory_mib, cpus in shapes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetless.sandbox.microvm_image",
                                     description="Build the microvm guest image.")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where to put it (default: $FLEETLESS_CACHE or "
                             "~/.cache/fleetless/microvm)")
    parser.add_argument("--force", action="store_true", help="rebuild even if it is there")
    parser.add_argument("--snapshot-memory", type=int, action="append", metavar="MIB",
                        help="guest RAM of a snapshot to build (repeatable; default 512)")
    parser.add_argument("--no-snapshot", action="store_true", help="build no snapshot")
    args = parser.parse_args(argv)
    try:
        directory = build_image(args.cache_dir, force=args.force)
        if not args.no_snapshot:
            for snap in build_snapshots(directory, [(m, 1) for m in args.snapshot_memory or [512]]):
                print(f"microvm snapshot in {snap}")
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    info = load_image(directory)
    m = info.manifest
    print(f"microvm image in {directory}: kernel {m.get('kernel_package')} "
          f"({int(str(m.get('kernel_bytes', 0))) >> 20} MiB), initramfs "
          f"{int(str(m.get('initramfs_bytes', 0))) >> 20} MiB, {m.get('python')} with "
          f"{m.get('stdlib_modules')} stdlib modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
