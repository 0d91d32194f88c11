"""The bwrap job's filesystem: the host paths it binds (the system, a synthesised ``/etc``, the
handler interpreter's prefixes), and, under a root drainer whose job uids cannot search everything,
the checks that they can reach what is bound and the launcher's view that binds the rest back
(:func:`_view`). The process tier uses the same paths for its root drainer's interpreter."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from .. import SandboxUnavailable, _hostuid, _subuid, _workspace
from ._launcher import _quote

MiB = 1024 * 1024
JOB_UID = 65534
WORKSPACE = "/workspace"
HANDLERS = "/handlers"

#: Top-level system paths: bound read-only, or re-created as the same symlink (merged /usr).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: /etc pieces the dynamic loader, libc and TLS clients need. Not passwd/shadow/group (a
#: one-line passwd and group are synthesised), not /etc/ssl/private.
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/services",
    "/etc/protocols",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/pki/tls/certs",
    "/etc/mime.types",
)
_ETC_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts")
_PASSWD = f"nobody:x:{JOB_UID}:{JOB_UID}:nobody:{WORKSPACE}:/usr/sbin/nologin\n"
_GROUP = f"nogroup:x:{JOB_UID}:\n"



def _leased() -> bool:
    """Whether jobs run as a leased uid: a root drainer's (:mod:`.._hostuid`), or a non-root
    drainer's with a subordinate range (:mod:`.._subuid`)."""
    return _hostuid.needed() or _subuid.delegation() is not None


_system_cache: dict[bool, list[str]] = {}


def _system_args(network: bool) -> list[str]:
    """Binds of the host system (computed once per process)."""
    cached = _system_cache.get(network)
    if cached is not None:
        return cached
    args: list[str] = []
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    _system_cache[network] = args
    return args


def _etc_paths(network: bool) -> list[str]:
    return [*_ETC_FILES, *(_ETC_NETWORK_FILES if network else ())]


def _etc_key(network: bool) -> tuple[bool, str, str]:
    return (network, _PASSWD, _GROUP)  # all that the copy holds besides the host files


def etc_dir(network: bool) -> Path:
    """The sandbox's ``/etc``: a copy of the few host files it needs plus a one-user passwd and
    group, bound read-only as a whole: one mount instead of a dozen, which is measurable per job.
    Made again when one of the host files changes (in place inside a copied directory too:
    :func:`.._workspace.signature`). Where jobs run as leased uids, that cannot
    write the drainer's work directory, one copy serves every drainer of the host (``etc-shared-*``,
    :func:`.._workspace.shared_copy`): its ~700 symlinks took 0.2 s of every drain's start on a
    slow disk. Otherwise one per drainer process (``etc-<drainer pid>-*``, swept with it)."""
    paths = _etc_paths(network)

    def build(d: Path) -> None:
        for p in paths:
            if not os.path.exists(p):
                continue
            dest = d / os.path.relpath(p, "/etc")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if os.path.isdir(p):
                shutil.copytree(p, dest, symlinks=True)
            else:
                shutil.copyfile(p, dest)  # content, also of a symlink (resolv.conf)
                os.chmod(dest, 0o644)
        (d / "passwd").write_text(_PASSWD)
        (d / "group").write_text(_GROUP)
        os.chmod(d, 0o755)

    if _leased():
        return _workspace.shared_copy("etc", _etc_key(network), _workspace.signature(paths), build)
    return _workspace.cached_copy("etc", network, _workspace.signature(paths), build)


def sweep_shared() -> int:
    """Remove the shared ``/etc`` copies and seccomp filters the host's files no longer make (after
    their grace)."""
    if not _leased():
        return 0
    from ._seccomp import shared_name

    current = {_workspace.shared_name("etc", _etc_key(n), _workspace.signature(_etc_paths(n))) for n in (False, True)}
    return _workspace.sweep_shared("etc", current) + _workspace.sweep_shared("bpf", {shared_name()})


_BOUND_ALREADY = ("/usr/",)
_prefix_cache: dict[str, list[str]] = {}
_prefix_locks: dict[str, threading.Lock] = {}
_prefix_locks_lock = threading.Lock()


def _covered(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def interpreter_paths(python: str) -> list[str]:
    """Paths to bind read-only (same path inside) that make ``python`` run in the sandbox: none for
    an interpreter under /usr; its ``sys.prefix``/``sys.base_prefix`` for a venv or pyenv build
    elsewhere, and the directories its ``sys.path`` reaches outside them (an editable install's
    source tree, a ``.pth`` entry), so handlers import what the app imports (asked of the
    interpreter once, with its site packages but no user site or environment; cached)."""
    cached = _prefix_cache.get(python)
    if cached is not None:
        return cached
    with _prefix_locks_lock:
        lock = _prefix_locks.setdefault(python, threading.Lock())
    with lock:  # one probe per interpreter: a caller during :func:`warm_interpreter_paths`' waits for it
        cached = _prefix_cache.get(python)
        if cached is not None:
            return cached
        return _probe_interpreter_paths(python)


def warm_interpreter_paths(python: str) -> None:
    """Probe ``python``'s paths in a background thread (for :func:`interpreter_paths`' cache)."""
    if python in _prefix_cache:
        return

    def probe() -> None:
        with contextlib.suppress(SandboxUnavailable, OSError):  # the check asks again and says why
            interpreter_paths(python)

    threading.Thread(target=probe, name="fleetless-interpreter-probe", daemon=True).start()


def _probe_interpreter_paths(python: str) -> list[str]:
    real = os.path.realpath(python)
    paths: list[str] = []
    if not (_covered(python, _BOUND_ALREADY) and _covered(real, _BOUND_ALREADY)):
        try:
            out = subprocess.run(
                [python, "-E", "-s", "-c", "import sys, json; print(json.dumps(sorted({sys.prefix, "
                 "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix} | {p for p in sys.path if "
                 "p.startswith('/')})))"],
                capture_output=True, env={}, timeout=30, check=True, stdin=subprocess.DEVNULL, cwd="/",
            ).stdout  # fmt: skip
            found = [p for p in json.loads(out) if p and os.path.exists(p)]
            prefixes = [p for p in found if not _covered(p, _BOUND_ALREADY)]
            prefixes = [p for p in prefixes if not any(q != p and _covered(p, [q]) for q in prefixes)]
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise SandboxUnavailable(f"cannot use {python} as the handler interpreter: {exc}") from exc
        prefixes = [p for p in prefixes if p != "/"]
        paths += prefixes
        for p in (python, real):
            if not _covered(p, _BOUND_ALREADY) and not _covered(p, prefixes):
                paths.append(p)
    binds = sorted(set(paths))
    _prefix_cache[python] = binds
    return binds


def _require_reachable(path: str, what: str, readable: bool = True) -> None:
    """SandboxUnavailable unless users other than the owner can reach ``path``: search permission on
    every directory up to it and on it, and (``readable``) read permission on it."""
    p = Path(path)
    for d in reversed(p.parents):
        if not os.stat(d).st_mode & 0o001:
            raise SandboxUnavailable(
                f"{what} {path} cannot be reached by the unprivileged job uids: {d} is not searchable "
                "by other users (chmod o+x it, or use a path outside it)"
            )
    mode = os.stat(p).st_mode
    if (readable and not mode & 0o004) or (p.is_dir() and not mode & 0o001):
        raise SandboxUnavailable(f"{what} {path} is not readable by other users (the unprivileged job uids)")


_checked_paths: set[tuple[str, str]] = set()


def _require_job_paths(python: str) -> None:
    """Under a root drainer bwrap runs as the job's uid and binds its sources by path as that uid:
    the work directory must be searchable by other users, the interpreter's paths readable (their
    parents need not be: see :func:`_view`). SandboxUnavailable naming the first that is not
    (checked once per pair)."""
    key = (str(_workspace.root()), python)
    if not _leased() or key in _checked_paths:
        return
    _require_reachable(key[0], "the work directory (FLEETLESS_WORKDIR)", readable=False)
    for path in interpreter_paths(python):  # a file the job cannot execute: that kind is not claimed
        real = os.path.realpath(path)  # what bwrap binds (it resolves every source)
        if _blocked_at(real) is not None:
            _require_reachable_itself(real, "the handler interpreter's")
        else:
            _require_reachable(real, "the handler interpreter's", readable=not os.path.isfile(real))
    _checked_paths.add(key)


def _require_reachable_itself(path: str, what: str) -> None:
    """SandboxUnavailable unless other users may read ``path`` (and search it, a directory) itself."""
    mode = os.stat(path).st_mode
    if os.path.isdir(path) and (mode & 0o005) != 0o005:
        raise SandboxUnavailable(f"{what} {path} is not readable by other users (the unprivileged job uids)")


# -- a root drainer's interpreter where the job uids cannot go ---------------------------------
def _blocked_at(path: str) -> str | None:
    """The first directory above ``path`` (the real one) that other users cannot search, under a
    root drainer or a non-root one with a subordinate range (whose bwrap, as the job's uid, resolves
    its bind sources by path); else None."""
    if not _leased():
        return None
    current = "/"
    for part in Path(os.path.realpath(path)).parts[1:-1]:
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


_view_cache: dict[tuple[str, ...], str] = {}


def blocked_paths(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(real path, the directory in its way) for each of ``paths`` that the job uids of a root
    drainer cannot reach for a directory above it (:func:`_blocked_at`); one inside another is
    left out (it comes with it)."""
    blocked = {os.path.realpath(p): _blocked_at(p) for p in paths}
    rescue = sorted((real, top) for real, top in blocked.items() if top is not None)
    return [(real, top) for real, top in rescue if not any(o != real and _covered(real, [o]) for o, _ in rescue)]


def _view(paths: Sequence[str]) -> str:
    """Shell commands that, run as root (or ns-root of a non-root drainer's holder, :mod:`.._subuid`:
    the drainer's own uid on the host) at a launcher's start in a mount namespace of its own, make
    each of ``paths`` (an interpreter under ``/root``, or under a 0700 directory of the drainer
    user's) reachable there by the job's uid: each path is opened first, then every directory in the way is covered by a
    small tmpfs (mode 0755) holding only the path, bound back from the open descriptor (the magic
    link reaches it without searching the directory in the way). bwrap, now the job's uid, then
    binds it read-only as any other; nothing changes on the host, and the namespace goes with the
    launcher. "" when every path is reachable as it is (the usual case: no namespace, no cost)."""
    rescue = blocked_paths(paths)
    key = tuple(real for real, _ in rescue)
    cached = _view_cache.get(key)
    if cached is not None:
        return cached
    tops = sorted({top for _, top in rescue})
    if len(tops) > 5:  # the launcher's shell has fds 5-9 for them
        raise SandboxUnavailable(f"the handler interpreter's paths are under {len(tops)} directories the "
                                 f"job uids cannot search ({', '.join(tops)}); at most 5 are bound back")
    fd = {top: 5 + i for i, top in enumerate(tops)}
    lines = []
    if rescue:  # the directory in the way is opened first; its content is reached through the fd
        lines.append("exec " + " ".join(f"{fd[top]}<{_quote(top)}" for top in tops) + " || exit 125")
        for top in tops:
            lines.append(f"mount -t tmpfs -o mode=0755,size=1m,nosuid,nodev fleetless-view {_quote(top)} || exit 125")
        for real, top in rescue:
            source = f"/proc/self/fd/{fd[top]}/{os.path.relpath(real, top)}"
            make = (f"mkdir -p {_quote(real)}" if os.path.isdir(real)
                    else f"mkdir -p {_quote(os.path.dirname(real))} && : > {_quote(real)}")
            lines.append(f"{make} && mount --no-canonicalize --rbind {_quote(source)} {_quote(real)} || exit 125")
        lines.append("exec " + " ".join(f"{fd[top]}<&-" for top in tops))
    view = "".join(line + "\n" for line in lines)
    _view_cache[key] = view
    return view


