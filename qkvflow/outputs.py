"""Output folders: probe that they can be written, and replace them without losing anyone's data.

* `check_writable(path, key)` creates and removes a probe file where `path` will be written (the
  folder itself, or its nearest existing ancestor when it does not exist yet, so nothing is created).
  Verbs call it for every output location before any work, so a read-only mount, a path under /proc
  or a path that is an existing file fails in one line at the start instead of at the first save
  hours later. Remote URLs (gs://, s3://, ...) are left to the library that writes them.
* `replacing(path, kind=..., key=...)` writes a whole output folder (an export, an adapter, a sweep
  table) into a temporary sibling and swaps it in only when the writer has finished, so a failed write
  never leaves a half-deleted folder. It replaces only what is provably qkvflow's own (`check_replaceable`):
  an absent or empty folder, or one holding `MARKER` from an earlier write of the same kind and no file
  that write did not list. It never replaces `/`, the home folder, the current folder, an ancestor of
  any of them, or a folder that holds a path the caller protects (the checkpoint or config being read),
  nor writes inside a folder the caller keeps apart (`outside`: e.g. the run folder of that checkpoint,
  whose step-N folders Levanter owns).
* `check_file(path, key, overwrite=...)` is the same for an output file (e.g. `qkvflow generate
  --output_jsonl`): a file path, not a folder, not a file the verb reads, outside the caller's folders,
  writable, and not an existing file unless the user passed `--overwrite` (`OVERWRITE_HELP`).
  `writing_file` writes it: into a temporary file beside it, renamed onto it only when complete, so
  a failed write leaves the old file as it was and no temporary file behind.
* `check_outside_repository(path, key)`: no output, file or folder, goes into the repository's tracked
  folders (`SHIPPED`) or onto its tracked top-level files (`SHIPPED_FILES`) when qkvflow runs from a
  checkout; both `check_file` and `check_replaceable` apply it. What the repository ships there
  (benchmarks/results/ included) is copied there by hand.

Every verb that writes a file goes through `check_file` / `writing_file` or writes inside a folder
that is already its own: an output folder of `replacing`, a run folder (Levanter's), the work folder
of a `bench compare` study (`qkvflow.bench.comparison.study_folder`) or the corpus cache. This module imports the
standard library and qkvflow.errors only, so that the CLI can check outputs before it imports JAX.

`MARKER` (`qkvflow_output.json`) names the kind of output, the qkvflow version and every file written;
`transformers` and PEFT ignore it when they load the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from qkvflow import __version__
from qkvflow.errors import UserError

MARKER = "qkvflow_output.json"
OVERWRITE_HELP = "Replace an existing output file or an earlier qkvflow output folder (refused without it)."
"""The help text of `--overwrite`, the same in every verb that writes files."""
ROOT = Path(__file__).resolve().parents[1]  # the checkout: qkvflow/outputs.py is one folder down
SHIPPED = (".ci", "benchmarks", "configs", "docs", "launch", "qkvflow", "tests")
"""The repository's top-level folders that git tracks (tests/test_outputs.py compares with git)."""
SHIPPED_FILES = (".gitignore", "CHANGELOG.md", "README.md", "mkdocs.yml", "pyproject.toml")
"""The repository's top-level files that git tracks."""
Pairs = Iterable[tuple[str, str]]
"""(description, path) pairs: the paths an output must not hold (`protect`) or lie inside (`outside`)."""


def is_remote(path) -> bool:
    return "://" in str(path)


def check_writable(path, key: str, *, beside: bool = False) -> None:
    """Raise `UserError` naming `key` and `path` unless a file can be created where `path` is (or
    would be); with `beside`, next to it instead (where `replacing` puts its temporary sibling)."""
    if path is None or is_remote(path):
        return
    target = os.path.abspath(os.path.expanduser(str(path)))
    existing = os.path.dirname(target) if beside else target
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == target else f"is inside {existing}, which is a file"
        raise UserError(f"{key}={str(path)!r} {where}: expected a folder that qkvflow can write to")
    try:
        fd, probe = tempfile.mkstemp(prefix=".qkvflow-write-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UserError(
            f"{key}={str(path)!r} cannot be written (creating a file in {existing} failed: "
            f"{e.strerror or e}): expected a folder that qkvflow can write to"
        ) from None


def _contains(folder: str, path: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_outside_repository(path, key: str) -> None:
    """Raise `UserError` in one line when `path` is one of the repository's tracked folders (`SHIPPED`), lies
    inside one, or is one of its tracked top-level files (`SHIPPED_FILES`). An installed qkvflow (no
    pyproject.toml beside the package) has no repository to protect."""
    if path is None or is_remote(path) or not (ROOT / "pyproject.toml").is_file():
        return
    real = os.path.realpath(os.path.expanduser(str(path)))
    for name in SHIPPED:
        folder = os.path.realpath(ROOT / name)
        if _contains(folder, real):
            raise UserError(
                f"{key}={str(path)!r} is inside the repository's shipped folder {name}/ ({folder}): "
                "choose a path outside the repository's tracked folders (e.g. under runs/ or /tmp)"
            )
    for name in SHIPPED_FILES:
        if real == os.path.realpath(ROOT / name):
            raise UserError(
                f"{key}={str(path)!r} is the repository's tracked file {name}: refusing to overwrite it; "
                f"choose another {key}"
            )


def _files(folder: str) -> list[str]:
    """Every file (and symbolic link) under `folder`, relative to it, sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, f), folder) for f in files]
        found += [os.path.relpath(os.path.join(root, d), folder) for d in dirs if os.path.islink(os.path.join(root, d))]
    return sorted(found)


def read_marker(folder: str):
    """The marker of a qkvflow output folder as a dict, or None (absent or unreadable)."""
    try:
        with open(os.path.join(folder, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(marker, dict) and isinstance(marker.get("kind"), str) and isinstance(marker.get("files"), list)
    return marker if ok else None


def write_marker(folder: str, kind: str) -> None:
    """Record `folder` as a qkvflow output of `kind` with the files it holds now (written last)."""
    marker = {"kind": kind, "qkvflow_version": __version__, "files": [f for f in _files(folder) if f != MARKER]}
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(marker, f, indent=1)


def _local(path) -> str | None:
    return None if path is None or is_remote(path) else os.path.realpath(os.path.expanduser(str(path)))


def check_outside(path, key: str, outside: Pairs = ()) -> None:
    """Raise `UserError` if `path` lies inside a folder of `outside`, (description, folder) pairs such as
    ("the run folder of --checkpoint", "checkpoints/run"); `path` being that folder itself is the
    caller's `protect` rule."""
    real = _local(path)
    for what, folder in outside:
        keep = _local(folder)
        if real is not None and keep is not None and real != keep and _contains(keep, real):
            raise UserError(f"{key}={str(path)!r} is inside {what} {str(folder)!r}: choose another {key} outside it")


def check_file(path, key: str, *, overwrite: bool = False, protect: Pairs = (), outside: Pairs = ()) -> None:
    """Raise `UserError` (one line naming `key` and `path`) unless a file can be written at `path`: a local
    path that is not a folder or a symbolic link, not one of the files of `protect` (description, path)
    that the verb reads, not inside a folder of `outside` (`check_outside`) or of the repository
    (`check_outside_repository`), not an existing file unless `overwrite`, and whose folder can be
    written (`check_writable`)."""
    shown = f"{key}={str(path)!r}"
    if is_remote(path):
        raise UserError(f"{shown} is a remote URL: expected a local file")
    real = _local(path)
    if os.path.isdir(real):
        raise UserError(f"{shown} is a folder: expected the path of a file to write")
    for what, keep in protect:
        if _local(keep) == real:
            raise UserError(f"{shown} is {what}: refusing to overwrite it; choose another {key}")
    check_outside(path, key, outside)
    check_outside_repository(path, key)
    given = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.islink(given):
        raise UserError(f"{shown} is a symbolic link: expected the path of a file to write")
    if os.path.exists(real) and not overwrite:
        raise UserError(f"{shown} exists: pass --overwrite to replace it, or choose another {key}")
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise UserError(f"{shown} cannot be written (the file is read-only): expected a file that qkvflow can write")
    check_writable(path, key, beside=True)


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def writing_file(path, key: str, *, overwrite: bool = False, protect: Pairs = (), outside: Pairs = ()) -> Iterator[str]:
    """Yield a temporary path beside `path` (same folder, same extension, so that e.g. matplotlib picks the
    format) for the caller to write the whole file into; when the block ends without an error, rename it
    onto `path` (atomic within a folder: a reader sees the old file or the new one, never a part). On an
    error the temporary file is removed and `path` is left as it was. `check_file` runs before and again
    just before the rename (a file that appeared meanwhile is refused without `overwrite`)."""
    protect, outside = list(protect), list(outside)
    check_file(path, key, overwrite=overwrite, protect=protect, outside=outside)
    target = os.path.abspath(os.path.expanduser(str(path)))
    parent, name = os.path.split(target)
    stem, ext = os.path.splitext(name)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.tmp-", suffix=ext, dir=parent)
    os.close(fd)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else _new_file_mode()
        os.chmod(tmp, mode)  # mkstemp makes it private; keep the old file's mode, or the umask's
        yield tmp
        check_file(path, key, overwrite=overwrite, protect=protect, outside=outside)
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def replace_whole(path: str, data: bytes) -> None:
    """`data` written to `path`, a file in a folder that is already the caller's (a run's record or metrics):
    into a temporary file beside it, flushed to disk and renamed onto it, so that a kill leaves the old file
    or the new one, never a part; on an error the temporary file is removed. No output rules apply: the
    folder is the run's, not a user's (`writing_file` is for those)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.remove(temporary)


def write_file(path, key: str, data: str | bytes, **rules) -> None:
    """`data` written to the output file `path` through `writing_file` (`rules`: its keyword arguments)."""
    with (
        writing_file(path, key, **rules) as tmp,
        open(tmp, "wb" if isinstance(data, bytes) else "w", encoding=None if isinstance(data, bytes) else "utf-8") as f,
    ):
        f.write(data)


def check_replaceable(
    path, *, kind: str, key: str, overwrite: bool = True, protect: Pairs = (), outside: Pairs = ()
) -> None:
    """Raise `UserError` (one line naming `key` and `path`) unless `path` may be replaced by a new
    output of `kind`. `protect` lists (description, path) pairs that must survive, e.g.
    ("the checkpoint", "checkpoints/run"); `outside` (description, folder) pairs that `path` must not
    lie inside (`check_outside`); `overwrite=False` refuses an earlier output too."""
    shown = f"{key}={str(path)!r}"
    if is_remote(path):
        raise UserError(f"{shown} is a remote URL: expected a local folder")
    check_outside(path, key, outside)
    check_outside_repository(path, key)
    given = os.path.abspath(os.path.expanduser(str(path)))
    real = os.path.realpath(given)
    guarded = [("the current folder", os.getcwd()), ("your home folder", os.path.expanduser("~"))]
    for what, keep in guarded + [(f"{what} {str(keep)!r}", keep) for what, keep in protect]:
        if (
            keep is not None
            and not is_remote(keep)
            and _contains(real, os.path.realpath(os.path.expanduser(str(keep))))
        ):
            raise UserError(f"{shown} is or holds {what}: refusing to replace it; choose another {key}")
    if os.path.islink(given):
        raise UserError(f"{shown} is a symbolic link: expected a folder (absent, empty, or an earlier qkvflow {kind})")
    if not os.path.exists(given):
        return
    if not os.path.isdir(given):
        raise UserError(f"{shown} is a file: expected a folder (absent, empty, or an earlier qkvflow {kind})")
    if not os.listdir(real):
        return
    marker = read_marker(real)
    if marker is None:
        raise UserError(
            f"{shown} is not empty and was not written by qkvflow (it has no readable {MARKER}): "
            f"refusing to replace it; remove it yourself or choose another {key}"
        )
    if marker["kind"] != kind:
        raise UserError(f"{shown} holds a qkvflow {marker['kind']}, not a {kind}: choose another {key}")
    listed = set(marker["files"]) | {MARKER}
    foreign = [f for f in _files(real) if f not in listed]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise UserError(
            f"{shown} holds {foreign[0]!r}{more}, which qkvflow did not write: refusing to replace it; "
            f"move it out or choose another {key}"
        )
    if not overwrite:
        raise UserError(f"{shown} holds an earlier qkvflow {kind}: pass --overwrite to replace it")


@contextlib.contextmanager
def replacing(
    path, *, kind: str, key: str, overwrite: bool = True, protect: Pairs = (), outside: Pairs = ()
) -> Iterator[str]:
    """Yield a fresh temporary sibling of `path` to write the new output into; when the block ends
    without an error, mark it and swap it in for `path` (the old folder is renamed aside, the new one
    renamed in, then the old one removed). On an error the temporary folder is removed and `path` is
    left exactly as it was. `check_replaceable` runs before and again just before the swap."""
    protect, outside = list(protect), list(outside)
    check_replaceable(path, kind=kind, key=key, overwrite=overwrite, protect=protect, outside=outside)
    target = os.path.abspath(os.path.expanduser(str(path)))
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        yield tmp
        write_marker(tmp, kind)
        check_replaceable(path, kind=kind, key=key, overwrite=overwrite, protect=protect, outside=outside)
        if os.path.lexists(target):
            aside = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.replace(target, os.path.join(aside, name))
            try:
                os.replace(tmp, target)
            except OSError:
                os.replace(os.path.join(aside, name), target)  # put the old one back
                os.rmdir(aside)
                raise
            shutil.rmtree(aside)  # the old output: empty, or every file listed in its marker
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already if it was swapped in
