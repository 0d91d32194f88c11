"""Kind -> handler resolution. The seed's contract: ``DIR/<kind>.py`` runs as
``python3 DIR/<kind>.py <workspace>/payload.json``; any executable ``DIR/<kind>`` (with a shebang)
runs the same way, so handlers can be written in any language.

A ``DIR/<kind>.py`` with a top-level ``def handle(`` is a handler *module*: it is imported once
per sandbox and ``handle(payload)`` is called once per job, its return value (JSON) being the
job's result. The file is read, never imported, by the drainer itself."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from . import handler_imports
from .job import validate_kind
from .sandbox import Sandbox, Template, passed_over

__all__ = ["Handler", "HandlersDirError", "check_dir", "kinds", "resolve", "unrunnable"]


class HandlersDirError(RuntimeError):
    pass


_HANDLE_RE = re.compile(rb"^def\s+handle\s*\(", re.MULTILINE)
_module_cache: dict[tuple[str, int, int, int], bool] = {}


def defines_handle(path: Path) -> bool:
    """Whether a Python handler defines a top-level ``handle`` (cached per file version)."""
    try:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _module_cache:
            _module_cache[key] = bool(_HANDLE_RE.search(path.read_bytes()))
        return _module_cache[key]
    except OSError:
        return False


@dataclass(frozen=True)
class Handler:
    kind: str
    filename: str  # relative to the handlers directory
    python: bool  # True: run with the sandbox's python; False: exec directly
    module: bool = False  # defines handle(payload): imported once per sandbox, called per job

    def argv(self, handlers_path: str, python: str, payload_path: str) -> list[str]:
        script = f"{handlers_path}/{self.filename}"
        return [python, script, payload_path] if self.python else [script, payload_path]


def check_dir(handlers_dir: Path) -> Path:
    """The directory as configured (absolute, symlinks *not* resolved: a deploy that swaps a
    ``current`` symlink mid-drain is followed), or a one-line error when it is not usable."""
    if not handlers_dir.exists():
        raise HandlersDirError(f"handlers directory {handlers_dir} does not exist")
    if not handlers_dir.is_dir():
        raise HandlersDirError(f"handlers directory {handlers_dir} is not a directory")
    if not os.access(handlers_dir, os.R_OK | os.X_OK):
        raise HandlersDirError(f"handlers directory {handlers_dir} is not readable")
    return Path(os.path.abspath(handlers_dir))


def resolve(handlers_dir: Path, kind: str) -> Handler | None:
    """The handler for ``kind``, or None when there is none."""
    validate_kind(kind)
    script = handlers_dir / f"{kind}.py"
    if script.is_file():
        return Handler(kind, script.name, python=True, module=defines_handle(script))
    program = handlers_dir / kind
    if program.is_file() and os.access(program, os.X_OK):
        return Handler(kind, program.name, python=False)
    return None


def missing(handlers_dir: Path, kind: str) -> str:
    """Why ``kind`` has no handler in ``handlers_dir``, in words, naming a file that looks meant for
    it (``render.sh``, ``render.js``, a ``render`` that is not executable): the handler of a kind is
    ``<kind>.py`` or an executable named exactly ``<kind>``."""
    said = f"neither {kind}.py nor an executable {kind} in {handlers_dir}"
    try:
        near = sorted(e.name for e in handlers_dir.iterdir()
                      if e.name != f"{kind}.py" and (e.name == kind or e.name.startswith(kind + ".")))
    except OSError:
        return said
    if not near:
        return said
    if near == [kind]:
        return f"{said} ({kind} is there but not executable: chmod +x it)"
    return (f"{said} ({near[0]} is there, but a handler's file name is the kind itself: rename it "
            f"{kind}.py, or {kind} with its #! line and chmod +x, or enqueue kind {near[0]!r})")


def _all(handlers_dir: Path) -> list[Handler]:
    """Every handler in the directory (files named ``<kind>.py`` or ``<kind>``, kind valid)."""
    found: dict[str, Handler] = {}
    for entry in sorted(handlers_dir.iterdir()):
        kind = entry.name.removesuffix(".py")
        try:
            validate_kind(kind)
        except ValueError:
            continue
        handler = resolve(handlers_dir, kind)
        if handler is not None:
            found[kind] = handler
    return list(found.values())


def kinds(handlers_dir: Path) -> frozenset[str]:
    """The kinds that have a handler in the directory now (a drain notes them when it starts)."""
    return frozenset(h.kind for h in _all(handlers_dir))


def close_kinds(name: str, known: Iterable[str]) -> list[str]:
    """The known kinds ``name`` looks like a misspelling of (difflib, as the queue commands' typo
    warning), closest first, at most three."""
    import difflib

    return difflib.get_close_matches(name, sorted(set(known) - {name}), n=3)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``did you mean resize?`` when ``name`` looks like a misspelling of known kinds, else ``""``:
    for the warnings about a kind with no handler."""
    close = close_kinds(name, known)
    return f"did you mean {' or '.join(close)}?" if close else ""


def _shebang(path: Path) -> tuple[str, str] | None:
    """(interpreter, its argument) of a ``#!`` line, ("", "") for an ELF program, None for neither."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return ("", "")  # unreadable: the sandbox will say so; nothing to check here
    if head.startswith(b"\x7fELF"):
        return ("", "")
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip()
    interpreter, _, arg = line.partition(" ")
    return interpreter, arg.strip()


def interpreter_of(handlers_dir: Path, handler: Handler, python: str | None,
                   tier_python: Callable[[], str]) -> str:
    """What runs ``handler``, for people to read: a ``.py`` handler's interpreter (``python``, the
    kind's or the drain's, else the tier's default ``tier_python()``), an executable's ``#!`` line,
    or ``(native program)``."""
    if handler.python:
        return python or tier_python()
    shebang = _shebang(handlers_dir / handler.filename)
    if shebang is None:
        return "(no #! line)"
    interpreter, arg = shebang
    return f"{interpreter} {arg}".strip() if interpreter else "(native program)"


def _find(backend: type[Sandbox], template: Template, program: str) -> str | None:
    """Where ``program`` (a path, or a name looked up on the job's PATH) is in the sandbox."""
    if "/" in program:
        return program if backend.has_program(template, program) else None
    for folder in template.env.get("PATH", os.defpath).split(":"):
        if folder.startswith("/") and backend.has_program(template, f"{folder.rstrip('/')}/{program}"):
            return f"{folder.rstrip('/')}/{program}"
    return None


def _not_executable(backend: type[Sandbox], template: Template, program: str) -> str | None:
    """Why the job's uid cannot execute ``program`` (a path, or a name on the job's PATH) although
    it is there, on a tier whose jobs run the host's files: a root drainer's jobs run as
    unprivileged uids that own nothing, so they need the "others" execute bit (on the file a
    symlink ends at); a non-root drainer's jobs are its own uid. None when it can, or is not there."""
    if not backend.runs_host_programs:
        return None
    path = program if "/" in program else shutil.which(program, path=template.env.get("PATH", os.defpath))
    if path is None or not os.path.isfile(path):
        return None
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return None
    if (st.st_mode & 0o001) if os.geteuid() == 0 else os.access(real, os.X_OK):
        return None
    owner = f"owner uid {st.st_uid}" + (f", {real}" if real != path else "")
    return f"exists but the job's uid cannot execute it (mode {st.st_mode & 0o7777:04o}, {owner})"


def _why_not(handler: Handler, handlers_dir: Path, backend: type[Sandbox], template: Template) -> str | None:
    where = f"in the {backend.name} sandbox"
    if handler.python:
        python = backend.handler_python(template)
        denied = _not_executable(backend, template, python)
        if denied is not None:
            return f"its interpreter {python} (for .py handlers) {denied}"
        if _find(backend, template, python) is None:
            return f"its interpreter {python} (for .py handlers) does not exist {where}"
        return _lacks_the_apps_packages(handler, handlers_dir, backend, template, python)
    shebang = _shebang(handlers_dir / handler.filename)
    if shebang is None:
        return f"{handler.filename} has no #! line and is not a program"
    interpreter, arg = shebang
    if not interpreter:
        return None
    if not interpreter.startswith("/"):
        return f"its #! line names {interpreter!r}, not an absolute path"
    denied = _not_executable(backend, template, interpreter)
    if denied is not None:
        return f"its interpreter {interpreter} (#!{interpreter}{' ' + arg if arg else ''}) {denied}"
    if not backend.has_program(template, interpreter):
        return f"its interpreter {interpreter} (#!{interpreter}{' ' + arg if arg else ''}) does not exist {where}"
    if os.path.basename(interpreter) == "env":
        words = [w for w in arg.split() if not w.startswith("-") and "=" not in w]
        denied = _not_executable(backend, template, words[0]) if words else None
        if denied is not None:
            return f"its interpreter {words[0]} (#!{interpreter} {arg}) {denied}"
        if words and _find(backend, template, words[0]) is None:
            path = template.env.get("PATH", os.defpath)
            return f"its interpreter {words[0]} (#!{interpreter} {arg}) is not on PATH {path} {where}"
    return None


def _lacks_the_apps_packages(handler: Handler, handlers_dir: Path, backend: type[Sandbox], template: Template,
                             python: str) -> str | None:
    """Where this tier passed fleetless's own interpreter over for the system's (the job uids cannot
    reach it) and the handler imports a package only the own one has: why its kind is not claimed
    (every attempt would fail with ModuleNotFoundError, charged; issue 28)."""
    own = sys.executable
    blocked = passed_over(own) if template.python is None and python != own else None
    if blocked is None:
        return None
    lacking = handler_imports.missing(handlers_dir / handler.filename, python)
    if not lacking:
        return None
    return (f"it imports {', '.join(lacking)}, which {python} lacks: on {backend.name} its handler would run under "
            f"{python}, not {own} (fleetless's own), which the job uids cannot reach ({blocked} is not searchable "
            "by others); use --sandbox bwrap or forkserver, move the environment, chmod o+x, or pass --python")


def unrunnable(handlers_dir: Path, backend: type[Sandbox], template: Template,
               interpreters: Mapping[str, str] | None = None) -> dict[str, str]:
    """Kinds whose handler cannot start where the job would run, each with the reason: a ``.py``
    handler whose interpreter (``interpreters[kind]``, else the template's) is not in the sandbox,
    a ``#!`` interpreter (or ``env``'s program) that is not there, a file that is neither script
    nor program. A drain checks this before it claims, and claims none of these kinds: running
    them would fail every attempt."""
    out: dict[str, str] = {}
    for handler in _all(handlers_dir):
        python = (interpreters or {}).get(handler.kind)
        kind_template = template if python is None else replace(template, python=python)
        reason = _why_not(handler, handlers_dir, backend, kind_template)
        if reason is not None:
            hint = backend.missing_program_hint
            plain = "not a program" in reason or "cannot execute" in reason or "cannot reach" in reason
            out[handler.kind] = reason + (f" ({hint})" if hint and not plain else "")
    return out
