"""Private files and folders: what air_magic keeps for a user stays that user's alone.

Its place in the flow: every folder and file that air_magic keeps outside a
call's own temp folder goes through here before it is written. The log root
(``output.make_log_dir``, every call), the warm starter's ``starter.log``
(``warm.Starter``), the embedded MLflow store and its artifacts (``tracking``)
and the UI server's log (``mlflow_ui``). Before each call makes its temp
folders, ``LocalBackend.run`` sweeps the temp folders that dead callers of this
user left behind (a SIGKILLed kernel cannot remove its ``payload.pkl``).

The rules (docs/security.md says why):

1. **A root folder is ours alone** (:func:`private_root`): owned by this user,
   writable by no one else (a group counts as someone else unless it is the
   user's own private group), inside folders that no other user can rename or
   replace. Anything else is refused with a :class:`ConfigurationError` that
   names the folder and the fix. A root is never chmod-ed: it may be a folder
   the user chose for more than this.
2. **A file is opened without following links** (:func:`open_private`):
   ``O_NOFOLLOW | O_CREAT`` with mode 0600; a symbolic link, a file that is not
   a regular file, a file of another user or with other hard links is refused.
   A file of ours that is looser than 0600 (made by an older version) is
   tightened.
3. **A temp folder names its owner** (:func:`private_tempdir`): the caller's
   pid, its start time and its pid namespace, so the next call can tell a dead
   caller's folder from a live one and remove it (:func:`sweep_dead_callers`).
   MLflow's own files under the embedded store are made private after each run
   (:func:`make_run_artifacts_private`): MLflow writes them with the umask.
"""

from __future__ import annotations

import errno
import functools
import grp
import hashlib
import os
import pwd
import re
import shutil
import stat
import tempfile
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

from air_magic import paths
from air_magic.errors import ConfigurationError
from air_magic.protocol.events import Outcome

TEMP_PREFIX = paths.TEMP_PREFIX
# mkdtemp's random part is [a-z0-9_]: the owner, after the last '.', cannot be mistaken for it.
_OWNED_NAME = re.compile(
    rf"^{re.escape(TEMP_PREFIX)}.*\.(?P<pid>\d+)-(?P<start>\d+)-(?P<space>[0-9a-f]{{8}})$"
)


# -- rule 1: root folders ------------------------------------------------------------------


def private_root(path: str, what: str, fix: str) -> str:
    """Create ``path`` (0700) if it is missing and return it; refuse it unless it is ours alone.

    ``what`` names the folder in messages ("the log folder"), ``fix`` says what the user can do.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot create {what} {path}: {exc.strerror}. {fix}; nothing was launched."
        ) from exc
    for folder in _folders_above(path):
        problem = _replaceable_by_others(folder)
        if problem:
            raise ConfigurationError(
                f"refusing {what} {path}: the folder {folder} above it {problem}, so another user "
                f"could replace it. {fix}; nothing was launched."
            )
    problem = _not_ours_alone(os.stat(path))
    if problem:
        raise ConfigurationError(f"refusing {what} {path}: it {problem}. {fix}; nothing was launched.")
    return path


def private_subfolder(path: str) -> str:
    """A folder we keep inside a checked root (the store's artifacts): 0700, ours, not a link."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigurationError(
            f"refusing {path}: it is not a folder of this user (a link, or someone else's); remove it"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours, made looser by an older version: MLflow fills it with the user's data
    return path


def _folders_above(path: str) -> list[str]:
    """Every folder whose entries decide what ``path`` is: above it as written, and above where it leads."""
    seen: list[str] = []
    for start in (os.path.abspath(path), os.path.realpath(path)):
        folder = os.path.dirname(start)
        while folder not in seen:
            seen.append(folder)
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)
    return seen


_shared_on_purpose: set[str] = set()


def accept_shared_folder(folder: str) -> None:
    """Take ``folder`` as safe above a root although others may write it: a Ray session's
    ``logs`` folder (Ray makes it 0777), where a Ray job's files must be for its dashboard to serve
    them; whoever can reach that dashboard reads them all anyway (docs/security.md)."""
    _shared_on_purpose.add(os.path.realpath(folder))


def _replaceable_by_others(folder: str) -> str | None:
    """Why another user could rename entries of ``folder``, or None. Sticky folders (/tmp) are fine."""
    if os.path.realpath(folder) in _shared_on_purpose:
        return None
    try:
        info = os.stat(folder)
    except OSError:
        return None  # gone or unreadable: the checks of the root itself still apply
    if info.st_uid not in (0, os.getuid()):
        return f"is owned by uid {info.st_uid}"
    if info.st_mode & stat.S_ISVTX:
        return None  # only an entry's owner may rename or remove it
    return _writable_by_others(info)


def _not_ours_alone(info: os.stat_result) -> str | None:
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    # Sticky or not: others who can create names in it can plant links and files we would open.
    return _writable_by_others(info)


def _writable_by_others(info: os.stat_result) -> str | None:
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IWOTH:
        return f"is writable by other users (mode {mode:o})"
    if mode & stat.S_IWGRP and not _is_own_private_group(info.st_gid):
        return f"is writable by other users: group {info.st_gid} may write it (mode {mode:o})"
    return None


@functools.lru_cache(maxsize=8)
def _is_own_private_group(gid: int) -> bool:
    """A "user private group" (umask 002 systems): our primary group, named after us, no other member."""
    try:
        me = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


# -- rule 2: files ---------------------------------------------------------------------------


def open_private(path: str, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """Open (creating, 0600) a file of ours in a folder of ours, never through a link; return the fd.

    Refused with a :class:`ConfigurationError`: a symbolic link (another user
    may have planted it to make us write into a file of our choosing), a file
    that is not regular (a FIFO would block us), a file of another user (our
    output would be theirs to read), a file with other hard links, a folder
    others can write.
    """
    folder_problem = _not_ours_alone(os.stat(os.path.dirname(path) or "."))
    if folder_problem:
        raise ConfigurationError(
            f"refusing to write {path}: its folder {folder_problem}. Use a folder only you can write."
        )
    # O_NONBLOCK: a FIFO planted there must not hang the call before the checks below refuse it.
    how = flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, how, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigurationError(
                f"refusing to write {path}: it is a symbolic link (someone may have planted it to "
                "make air_magic write into another file). Remove it and check who can write its folder."
            ) from None
        raise
    try:
        info = os.fstat(fd)
        _check_own_file(path, info)
        if stat.S_IMODE(info.st_mode) != 0o600:  # already 0600: no write, so a read-only folder works
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def opener(path: str, flags: int) -> int:
    """For ``open(path, mode, opener=private_files.opener)``: :func:`open_private` with open()'s flags."""
    return open_private(path, flags)


def create_private_file(path: str) -> None:
    """Make sure ``path`` exists as a 0600 file of ours (before another library opens it)."""
    os.close(open_private(path, os.O_RDONLY))  # read-only: creating and fchmod need no more


def _check_own_file(path: str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ConfigurationError(f"refusing to write {path}: it is not a regular file; remove it")
    if info.st_uid != os.getuid():
        raise ConfigurationError(
            f"refusing to write {path}: it is owned by uid {info.st_uid}, not by you (uid {os.getuid()}); "
            "remove it"
        )
    if info.st_nlink != 1:
        raise ConfigurationError(f"refusing to write {path}: it has other hard links; remove it")


# -- the embedded MLflow store ---------------------------------------------------------------


def private_store(folder: str, database: str, subfolders: Iterable[str]) -> str:
    """The embedded store's folder, checked; its database made 0600 before MLflow first opens it.

    sqlite gives its journal (``-journal``, ``-wal``, ``-shm``) the database's
    mode, so a 0600 database keeps them 0600 too. MLflow makes the folders and
    files inside ``subfolders`` with the process umask; 0700 subfolders keep
    them closed, and :func:`make_run_artifacts_private` tightens them after a run.
    """
    private_root(
        folder,
        "the embedded MLflow store's folder",
        "Set AIR_MAGIC_MLFLOW_DIR to a folder only you can write, or pass tracking=False",
    )
    for name in (database, f"{database}-journal", f"{database}-wal", f"{database}-shm"):
        path = os.path.join(folder, name)
        if name == database or os.path.lexists(path):
            create_private_file(path)
    for name in subfolders:
        private_subfolder(os.path.join(folder, name))
    return folder


def make_run_artifacts_private(client: Any, run_id: str, store_folder: str) -> None:
    """0700 folders, 0600 files for a run's artifacts, when they lie in our embedded store."""
    uri = urllib.parse.urlparse(str(client.get_run(run_id).info.artifact_uri))
    if uri.scheme != "file":
        return
    path = os.path.realpath(urllib.parse.unquote(uri.path))
    store = os.path.realpath(store_folder)
    if path == store or os.path.commonpath([path, store]) != store:
        return  # not ours to change: the user chose where this experiment keeps its artifacts
    make_tree_private(path)
    folder = os.path.dirname(path)
    while folder != store:  # the experiment's and the run's folders, which MLflow made too
        make_tree_private(folder, recursive=False)
        folder = os.path.dirname(folder)


def make_tree_private(root: str, recursive: bool = True) -> None:
    """chmod what is ours under ``root``: folders 0700, regular files 0600; links are left alone."""
    if not recursive:
        _make_private(root)
        return
    for folder, dirs, files in os.walk(root):
        for path in [folder, *(os.path.join(folder, n) for n in files)]:
            _make_private(path)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]


def _make_private(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if info.st_uid != os.getuid():
        return
    wanted = 0o700 if stat.S_ISDIR(info.st_mode) else 0o600 if stat.S_ISREG(info.st_mode) else None
    if wanted is not None and stat.S_IMODE(info.st_mode) != wanted:
        os.chmod(path, wanted)


# -- rule 3: temp folders that name their owner ------------------------------------------------


def private_tempdir(kind: str) -> str:
    """``tempfile.mkdtemp`` (0700) named ``air_magic-<kind>-<random>.<owner>``, sweepable once we die."""
    return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{kind}-", suffix=f".{owner_tag()}")


def owner_tag() -> str:
    """This process, in a form that survives pid reuse and shared temp folders: pid-start-space."""
    return process_tag(os.getpid())


def pid_space() -> str:
    """Which pids ours can be compared with (this boot, this pid namespace), as a short name."""
    return _pid_space()


def process_tag(pid: int) -> str:
    """Process ``pid`` as :func:`owner_tag` names it (:func:`owner_alive` checks it later)."""
    return f"{pid}-{_start_time(pid)}-{_pid_space()}"


def dead_callers_folders(kind: str | None = None, folder: str | None = None) -> list[str]:
    """This user's temp folders (of ``kind``, or of any) whose caller is dead.

    Only folders that name their owner (:func:`private_tempdir`) are looked at, and only those
    of this user, made in this pid namespace on this boot: a pid from elsewhere (a container
    sharing /tmp) cannot be looked up here.
    """
    folder = folder or tempfile.gettempdir()
    prefix = f"{TEMP_PREFIX}{kind}-" if kind else TEMP_PREFIX
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return []
    found = []
    for name in names:
        owner = _OWNED_NAME.match(name)
        if owner is None or owner["space"] != _pid_space():
            continue  # an older version's folder, or another machine's or container's
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        if mine and not _alive(int(owner["pid"]), int(owner["start"])):
            found.append(path)
    return found


def remove_tree(path: str) -> None:
    """Remove a folder of ours; never follows links; another sweeper may race us."""
    shutil.rmtree(path, ignore_errors=True)


# A dead caller's metric folder that names its run waits for the run's import (tracking/
# metric_writer.import_left_behind, at the next tracked call into that store) this long at most.
METRICS_KEPT_S = 7 * 24 * 3600


def sweep_dead_callers(folder: str | None = None) -> list[str]:
    """Remove this user's temp folders whose caller is dead; return the names removed.

    A metric folder that names its MLflow run and holds rows (or the call's outcome) is left for
    that run's import (its rows are the training's record), unless it is older than
    :data:`METRICS_KEPT_S`; one that holds nothing more goes.
    """
    removed = []
    for path in dead_callers_folders(None, folder):
        name = os.path.basename(path)
        if name.startswith(f"{TEMP_PREFIX}{paths.METRICS_KIND}-"):
            try:
                named = os.stat(os.path.join(path, paths.METRICS_RUN_FILE)).st_mtime
            except OSError:
                named = None
            if named is not None and time.time() - named < METRICS_KEPT_S and _worth_keeping(path):
                continue
        remove_tree(path)
        removed.append(name)
    return removed


def _worth_keeping(metrics_folder: str) -> bool:
    """A dead caller's metric folder holds something its run lacks: rows, or the call's outcome."""
    try:
        entries = list(os.scandir(metrics_folder))
    except OSError:
        return False
    return any(
        e.name == paths.METRICS_OUTCOME_FILE or (e.name.endswith(".tsv") and e.stat().st_size > 0)
        for e in entries
    )


def call_still_running(summary: dict[str, object]) -> bool | None:
    """A call's summary (its run.json) says it runs: whether the process running it (its owner:
    a kernel, a script, a detached run's supervisor) still does. None: the summary says it ended."""
    if summary.get("outcome") != Outcome.RUNNING:
        return None
    return owner_alive(str(summary.get("owner", "")))


def owner_alive(tag: str) -> bool:
    """The process an :func:`owner_tag` names still runs (a tag of another machine: assumed alive)."""
    try:
        pid, start, space = tag.split("-", 2)
    except ValueError:
        return False
    if space != _pid_space():
        return True
    return _alive(int(pid), int(start))


def _alive(pid: int, start: int) -> bool:
    """The owner still runs: same pid, same start, not a zombie. When unsure, alive (keep its folder)."""
    try:
        state, started = _proc_stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return not os.path.isdir("/proc/self")  # no /proc at all: we cannot tell, so never sweep
    except (OSError, ValueError, IndexError):
        return True
    return started == start and state != "Z"


def _start_time(pid: int) -> int:
    try:
        return _proc_stat(pid)[1]
    except (OSError, ValueError, IndexError):
        return 0  # no /proc: such folders are never swept (see _alive)


def _proc_stat(pid: int) -> tuple[str, int]:
    """State and start time of ``pid``: clock ticks since boot (/proc/<pid>/stat, field 22).

    Not a wall-clock start time (psutil's create_time): that one moves when the
    clock is stepped, and a live caller would then look dead.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        after_name = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return after_name[0].decode(), int(after_name[19])


@functools.lru_cache(maxsize=1)
def _pid_space() -> str:
    """Which pids ours can be compared with: this boot and this pid namespace, hashed short."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: one space for every process (no container can share our temp folder)
        boot, namespace = "", 0
    return hashlib.sha1(f"{boot}|{namespace}".encode()).hexdigest()[:8]
