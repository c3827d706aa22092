"""`CoreLaunch`: where the server's engine core runs, started until its Ready, watched, and stopped.

`start(in_process=False)` spawns `python -m iterserve.server.engine.core_proc` (torch, the weights, the
grammar engine: all in that process) and loads the tokenizer in this one meanwhile, so the two overlap and
this process imports no torch. `start(in_process=True)` builds the core here and runs its loop in a thread
(tests that reach into the engine, debugging), over queues instead of ZeroMQ. Either way the caller gets
the channel to talk to the core over, the core's Ready and the tokenizer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
from typing import TYPE_CHECKING

import msgspec

from iterserve.server.config import EngineConfig
from iterserve.server.engine.channels import QueueChannel, ZmqChannel
from iterserve.server.engine.messages import FromCore, Ready, StartupFailed

if TYPE_CHECKING:  # torch is the core's, not imported here at run time
    from iterserve.server.engine.core import EngineCore
    from iterserve.server.model.tokenizer import Tokenizer


class CoreLaunch:
    def __init__(self, config: EngineConfig, log_level: str = "warning"):
        self.config = config
        self.log_level = log_level
        self.core: EngineCore | None = None  # the EngineCore itself, in-process only
        self.channel: QueueChannel | ZmqChannel | None = None  # this end of the link, once started
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._tmp: str | None = None

    def start(self, in_process: bool) -> tuple[Ready, Tokenizer | None]:
        """Start the core and wait for its Ready. A bad model or flag raises what building the engine
        raises (InvalidRequestError, FileNotFoundError, ValueError), naming it."""
        return self._start_thread() if in_process else self._start_process()

    def _start_thread(self) -> tuple[Ready, Tokenizer | None]:
        from iterserve.server.engine.core_proc import EngineCoreLoop, ready_message
        from iterserve.server.engine.engine_factory import build_engine_core

        built = build_engine_core(self.config)
        self.core = built.core
        self.channel, core_end = QueueChannel.pair()
        loop = EngineCoreLoop(built.core, core_end)
        self._thread = threading.Thread(target=loop.run, name="iterserve-engine-core", daemon=True)
        self._thread.start()
        return ready_message(built, loop.snapshot()), built.tokenizer

    def _start_process(self) -> tuple[Ready, Tokenizer | None]:
        # neither imports torch, which this process never needs: the core's process starts first, and this
        # one loads the tokenizer meanwhile
        from iterserve.server.engine.messages import raise_startup_failure
        from iterserve.server.model.tokenizer import load_config_tokenizer

        self._tmp = tempfile.mkdtemp(prefix="iterserve-core-")
        to_core, from_core = f"ipc://{self._tmp}/to-core", f"ipc://{self._tmp}/from-core"
        self.channel = channel = ZmqChannel(to_core, from_core, FromCore, bind=True)
        self._proc = proc = subprocess.Popen([
            sys.executable, "-m", "iterserve.server.engine.core_proc", "--input", to_core, "--output", from_core,
            "--config", msgspec.json.encode(self.config).decode(), "--log-level", self.log_level])
        try:
            tokenizer = load_config_tokenizer(self.config)  # while the core loads the weights
            while True:
                for message in channel.receive(0.5):
                    if isinstance(message, Ready):
                        return message, tokenizer
                    if isinstance(message, StartupFailed):
                        raise_startup_failure(message)
                if proc.poll() is not None:
                    raise RuntimeError(f"the engine core exited with status {proc.returncode} before it "
                                       "was ready (its log is above)")
        except BaseException:
            self.stop(timeout=5)
            raise

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self._thread is not None and self._thread.is_alive()

    @property
    def exit_status(self) -> int | None:
        """The core process's exit status (None: running, or a thread)."""
        return self._proc.returncode if self._proc is not None else None

    def stop(self, timeout: float) -> None:
        """Wait for the core (told to shut down, or gone) to end, killing a process that does not, and
        close the link."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self.channel is not None:
            self.channel.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
