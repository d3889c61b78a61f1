"""`python -m engine.train ...` and `python -m launch ...` as processes forked from an
interpreter that has imported torch.

A short engine run spends most of its time importing: torch, then torch._dynamo on the first
optimizer (torch.optim's methods are wrapped by torch._disable_dynamo), ~3-8 s of CPU per
process here against ~1 s of training; launch's check of a request (`engine.train --check`, a
process of its own) ~2 s. A multiprocessing forkserver (the library's) imports them once per
test process and forks each command from that state: a process of its own (its exit code,
files, signals, threads; the engine, launch and the recipes imported fresh in it from its
working folder, as `python -m` would) that starts in ~0.1 s. In a forked `python -m launch`,
the checks it runs through launch.check.run_check are forked from it in turn.

A command whose environment changes what the interpreter's start or those imports read
(PYTHON*, TORCH*, CUDA_*, a sitecustomize on PYTHONPATH that does more than hide modules,
...) starts a fresh interpreter as before, and so does every command while TESTS_COLD_PROCESSES=1 is set: the way to check that
a test does not depend on the shortcut (tests/project/test_warm.py compares the two)."""

from __future__ import annotations

import ast
import atexit
import importlib.util
import logging
import multiprocessing
import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing import connection, forkserver
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torchvision"]
# Read by the interpreter's start or by the imports above: a run that sets them otherwise than
# the server's environment (tests.helpers.engine_env()) gets a fresh interpreter. Not
# PYTHONPATH and PYTHONDONTWRITEBYTECODE, which the forked process applies itself, nor
# OMP_NUM_THREADS, whose thread count it sets as torch would have read it. Not KMP_*: torch's
# wheels here link GNU OpenMP (libgomp), which reads none; scikit-learn's and joblib's imports
# write two of them into the environment of a test process.
AT_IMPORT = (
    "PYTHON", "OMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
    "NVIDIA_", "LD_", "MALLOC", "TMP", "TEMP",
)  # fmt: skip
APPLIED = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS")
# Read when used, not at import (torch.hub's folder; inductor's cache, which inductor itself
# sets in the environment of the process that compiled first).
READ_LATER = ("TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR")
# The command lines a forked `python -m launch` runs forked in turn (launch.check's checks).
FORKED_MODULES = ("engine.train", "engine.resolved")
# The environment the test process started with: the server's is engine_env() of it, not of
# whatever a test has set (TORCH_LOGS, CUDA_VISIBLE_DEVICES) when the first command starts.
STARTED_WITH = dict(os.environ)
# train.compile's values that compile nothing on a CPU (YAML reads on/off as booleans).
NOT_COMPILED = ("auto", "off", "false")
_server_env: dict[str, str] | None = None
_started: list[bool] = []


def server_env() -> dict[str, str]:
    """tests.helpers.engine_env() as of the test process's start: the server's environment."""
    global _server_env
    if _server_env is None:
        from tests.helpers import engine_env

        now = dict(os.environ)
        os.environ.clear()
        os.environ.update(STARTED_WITH)
        try:
            _server_env = engine_env()
        finally:
            os.environ.clear()
            os.environ.update(now)
    return _server_env


def usable(env: dict[str, str], engine_argv=(), cwd: Path | None = None) -> bool:
    """Whether a process with this environment (and, for `engine.train`, this command line in
    cwd) may be forked from the server."""
    if os.environ.get("TESTS_COLD_PROCESSES") or env.get("TESTS_COLD_PROCESSES"):
        return False
    if engine_argv and compiles(list(engine_argv), cwd or Path.cwd()):
        return False
    server = server_env()
    names = {k for k in (*env, *server) if k.startswith(AT_IMPORT)} - {*APPLIED, *READ_LATER}
    hooks = _startup_hooks(env)
    if hooks and (hooks[0].name != "sitecustomize.py" or hidden_modules(hooks[0]) is None):
        return False
    return all(env.get(k) == server.get(k) for k in names)


def compiles(engine_argv: list[str], cwd: Path) -> bool:
    """Whether `engine.train engine_argv` asks torch.compile for a model, in an override or in
    its --config (a variant or a file): inductor's compile workers hung in a process forked
    from the server (a CI run, 2026-12-07), so such a run starts fresh. Read with the engine's
    own parser; a command it refuses builds no model."""
    from engine import catalog, cli
    from engine.config import ConfigError, read_yaml

    try:
        request = cli.parse_argv(engine_argv)
        asked = [o.split("=", 1)[1] for o in request.overrides if o.startswith("train.compile=")]
        if request.config and not request.check:
            path = Path(request.config) if catalog.is_config_file(request.config) else None
            path = cwd / path if path else catalog.variant_path(request.recipe, request.config)
            train = read_yaml(path).get("train") or {}
            asked.insert(0, train.get("compile", "auto"))
    except (ConfigError, OSError):
        return False
    return not request.check and bool(asked) and str(asked[-1]).lower() not in NOT_COMPILED


def _startup_hooks(env: dict[str, str]) -> list[Path]:
    """The sitecustomize or usercustomize modules on env's PYTHONPATH, which only an
    interpreter's start runs (tests/engine/test_optional_deps.py hides packages with one)."""
    folders = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    names = ("sitecustomize.py", "usercustomize.py")
    return [folder / name for folder in folders for name in names if (folder / name).exists()]


def hidden_modules(hook: Path) -> list[str] | None:
    """The modules a startup hook hides, where that is all it does (`import sys`, then
    `sys.modules["name"] = None` lines: how the tests stand in for a machine without an
    optional package); None for any other hook."""
    names = []
    for statement in ast.parse(hook.read_text()).body:
        if isinstance(statement, ast.Import) and [a.name for a in statement.names] == ["sys"]:
            continue
        match statement:
            case ast.Assign(
                targets=[
                    ast.Subscript(
                        ast.Attribute(ast.Name("sys"), "modules"), ast.Constant(str() as name)
                    )
                ],
                value=ast.Constant(None),
            ):
                names.append(name)
            case _:
                return None
    return names


def _run_startup_hook(env: dict[str, str], module: str, argv: list[str]) -> None:
    """The sitecustomize on PYTHONPATH (usable() let only one that hides modules through), run
    as the interpreter's start would have. Where the server imported a module it hides, that
    module cannot be hidden any more: this process becomes a fresh interpreter instead (exec:
    the same process, files and exit code)."""
    hooks = _startup_hooks(env)
    if not hooks:
        return
    hidden = hidden_modules(hooks[0]) or []
    if any(m == name or m.startswith(f"{name}.") for m in sys.modules for name in hidden):
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    spec = importlib.util.spec_from_file_location("sitecustomize", hooks[0])
    hook = sys.modules["sitecustomize"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)


def _context():
    """The forkserver context, its server started (once) under server_env()."""
    context = multiprocessing.get_context("forkserver")
    if not _started:
        context.set_forkserver_preload(PRELOAD)
        now = dict(os.environ)
        os.environ.clear()
        os.environ.update(server_env())
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(now)
        _started.append(True)
    return context


def _interpreter_path() -> list[str]:
    """The interpreter's own entries of sys.path (the standard library, site-packages)."""
    prefixes = (sys.prefix, sys.base_prefix)
    return [p for p in sys.path if p and p.startswith(prefixes)]


def _exit_code(exit: SystemExit) -> int:
    """What the interpreter makes of an uncaught SystemExit."""
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def _redirect(stdin: str | None, out: str, err: str) -> None:
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        if path is not None:
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
    if stdin is not None:  # multiprocessing left sys.stdin on a /dev/null of its own
        sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115


def _become(module: str, argv: list[str], env: dict, cwd: str) -> None:
    """In a forked process: `python -m module argv` as the interpreter would run it under env in
    cwd, then its exit (non-daemon threads joined, atexit handlers run, output flushed)."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *_interpreter_path()]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    _run_startup_hook(env, module, argv)
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() else len(os.sched_getaffinity(0)))
    sys.argv = ["-m", *argv]
    sys.orig_argv = [sys.executable, "-m", module, *argv]
    _default_start_method()
    if module == "engine.train" and "--spawn" in argv:
        _fork_server_ahead()
    code = 0
    try:
        if module == "launch":
            _fork_checks()
            subprocess.Popen = ForkingPopen  # a sweep's members, a claim's rerun
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = _exit_code(exit)
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _default_start_method() -> None:
    """No multiprocessing start method chosen, as in a fresh interpreter. A fork server's child
    inherits its parent's ("forkserver"): a DataLoader's workers then started from a fork
    server of their own, an interpreter importing torch (seconds per loader), instead of
    forking as Linux's default does."""
    multiprocessing.set_start_method(None, force=True)


def _fork_server_ahead() -> None:
    """The fork server `--spawn` starts (engine.spawn), forked now from this process (a fresh
    interpreter's state with torch imported) rather than started when the engine asks for it
    as an interpreter that imports torch again: ~4 s of CPU per run. When the engine asks, it
    runs the library's own server (forkserver.main) with what the engine asks for then: the
    preload list, the environment and the folder of that moment, sys.path as `python -c`
    makes it. If by then the environment differs in what an interpreter's start reads, the
    library starts its fresh interpreter instead."""
    server = forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # as ForkServer.ensure_running makes them
    order_r, order_w = os.pipe()
    started_env = dict(os.environ)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            os.close(order_w)
            with os.fdopen(order_r, "rb") as order:
                asked = order.read()
            if asked:  # nothing: the engine started no server
                preload, env, cwd = pickle.loads(asked)
                os.environ.clear()
                os.environ.update(env)
                os.chdir(cwd)
                extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
                sys.path[:] = ["", *extra, *_interpreter_path()]
                forkserver.main(listener.detach(), alive_r, preload)
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    os.close(order_r)
    library = server.ensure_running

    def ensure_running() -> None:
        del server.ensure_running  # the library's from now on
        env = dict(os.environ)
        if any(
            env.get(k) != started_env.get(k)
            for k in env.keys() | started_env.keys()
            if k.startswith(AT_IMPORT) and k not in APPLIED + READ_LATER
        ):
            os.close(order_w)  # the forked server ends unused
            os.unlink(address)
            return library()
        with os.fdopen(order_w, "wb") as order:
            order.write(pickle.dumps((server._preload_modules, env, os.getcwd())))
        server._forkserver_address, server._forkserver_alive_fd = address, alive_w
        server._forkserver_pid = pid
        return library()  # the resource tracker; the server is found running

    server.ensure_running = ensure_running


def _served(module, argv, env, cwd, stdin, out, err) -> None:
    """The forkserver's process: its output to the files, then the command."""
    _redirect(stdin, out, err)
    _become(module, argv, env, cwd)


def _fork_checks() -> None:
    """launch's checks (`python -m engine.train ... --check`), forked from this process rather
    than started cold: launch.check.run_check is the one place launch runs them."""
    from launch import check

    cold = check.run_check

    def run_check(argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
        if argv[:2] != [sys.executable, "-m"] or argv[2] not in FORKED_MODULES:
            return cold(argv, stdin)
        done = _fork(argv[2], argv[3:], dict(os.environ), str(check.ROOT), stdin)
        return done.returncode, done.stdout, done.stderr

    check.run_check = run_check


def _forkable(env: dict[str, str], engine_argv: list[str], cwd: str) -> bool:
    try:
        return usable(env, engine_argv, Path(cwd))
    except ImportError:  # a stand-in engine without engine.cli (launch's tests): start it fresh
        return False


class ForkingPopen(subprocess.Popen):
    """subprocess.Popen that forks `python -m engine.train ...` from this warm process (as
    _fork does), its standard streams, process group and session as asked; any other command,
    or one a fresh interpreter would start otherwise (usable()), is started as before. The
    forked process keeps this one's other open files, as a forked check does."""

    forked: list[int] = []  # the pids it forked (tests/project/test_warm.py)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        argv = list(args) if isinstance(args, list | tuple) else []
        cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
        forked = (
            argv[:2] == [sys.executable, "-m"]
            and len(argv) > 2
            and argv[2] in FORKED_MODULES
            and preexec_fn is None
            and threading.active_count() == 1
            and _forkable(dict(os.environ if env is None else env), argv[3:], cwd)
        )
        if not forked:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest
            )
        # startupinfo, creationflags, shell, the six pipe ends, restore_signals, gid, gids,
        # uid, umask, start_new_session, process_group (subprocess.py, POSIX)
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = rest[3:9]
        start_new_session, process_group = rest[-2:]
        sys.stdout.flush()
        sys.stderr.flush()
        ready_read, ready_write = os.pipe()  # as Popen returns once its child has exec'd
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ready_read)
                if start_new_session:
                    os.setsid()
                if process_group >= 0:
                    os.setpgid(0, process_group)
                os.close(ready_write)  # its session and group are set
                for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, target)
                for fd in {p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite} - {-1, 0, 1, 2}:
                    os.close(fd)
                _as_new_process()
                _become(argv[2], argv[3:], dict(os.environ if env is None else env), cwd)
            finally:
                os._exit(1)
        os.close(ready_write)
        os.read(ready_read, 1)
        os.close(ready_read)
        self.pid = pid
        self._child_created = True
        self.forked.append(pid)
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _fork(module: str, argv: list[str], env: dict, cwd: str, stdin: str | None, timeout=600):
    """`python -m module argv`, forked from this (warm, single-threaded) process."""
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder, name) for name in ("stdin", "stdout", "stderr")]
        for path, text in zip(paths, (stdin or "", "", ""), strict=True):
            path.write_text(text)
        sys.stdout.flush()  # or the child would print what this process buffered
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _as_new_process()
                _redirect(*map(str, paths))
                _become(module, argv, env, cwd)
            finally:
                os._exit(1)
        return _collect(pid, [module, *argv], paths[1:], timeout)


def _as_new_process() -> None:
    """What a fresh interpreter would not inherit from this one: the modules imported from
    outside the interpreter's own folders (launch's, the engine's it shares: imported again,
    fresh), its exit handlers (launch's own would run twice) and signal handlers."""
    prefixes = (sys.prefix, sys.base_prefix)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and not path.startswith(prefixes):
            del sys.modules[name]
    atexit._clear()
    atexit.register(logging.shutdown)  # logging was imported before: what its import registers
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _collect(pid: int, args: list[str], outputs: list[Path], timeout: float):
    """Waits for a forked process (killed after timeout, as subprocess.run would)."""
    pidfd = os.pidfd_open(pid)
    try:
        if not select.select([pidfd], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(args, timeout)
    finally:
        os.close(pidfd)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out, err = (path.read_text() for path in outputs)
    return subprocess.CompletedProcess([sys.executable, "-m", *args], code, out, err)


def run(module: str, argv: list[str], env: dict, cwd: Path, timeout: float):
    """`python -m module argv` forked from the server: a CompletedProcess as subprocess.run
    with capture_output=True, text=True would give (TimeoutExpired once timeout passes)."""
    context = _context()
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        args = (module, list(argv), dict(env), str(cwd), None, str(out), str(err))
        process = context.Process(target=_served, args=args)
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([module, *argv], timeout)
        command = [sys.executable, "-m", module, *argv]
        return subprocess.CompletedProcess(
            command, process.exitcode, out.read_text(), err.read_text()
        )
