"""Headless Chromium driven over the DevTools protocol through a pipe (`--remote-debugging-pipe`): no
websocket, no Python dependency, only a `chromium` (or `google-chrome`) binary.

    with Browser.launch(tmp_path / "profile") as b:
        b.open(page_path)                  # waits for the load event
        b.eval("document.title")           # Runtime.evaluate, by value; awaits a promise
        png = b.screenshot(full=True)

Chromium reads commands from fd 3 and writes replies and events to fd 4, each message one JSON
object followed by a NUL byte. Flags: headless, no sandbox (tests run as root), and nothing that
reaches the network (no component updates, sync, background networking or QUIC).
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe")


# the Debian package: what `make test`'s set-up installs, and what ensure_chromium() installs when missing
APT_INSTALL = ("apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium")
INSTALL_TIMEOUT_S = 900


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class ChromiumUnavailable(RuntimeError):
    """Chromium is not on PATH and cannot be installed on this machine (the message says why)."""


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(args, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S)


_installed: list[str] = []  # one install attempt per test session


def ensure_chromium() -> str:
    """The chromium binary: found on PATH, else installed with apt-get (the package lists refreshed
    first). ChromiumUnavailable, with the reason, only where it cannot be installed: no apt-get, not
    root, or apt-get failing (no network, no such package)."""
    path = find_chromium()
    if path:
        return path
    if _installed:
        raise ChromiumUnavailable(_installed[0])
    why = _install()
    _installed.append(why)
    path = find_chromium()
    if path:
        return path
    raise ChromiumUnavailable(why)


def _install() -> str:
    """Try to install chromium; the reason it is still missing (read only if it is)."""
    if shutil.which("apt-get") is None:
        return "no chromium on PATH and no apt-get to install it"
    if os.geteuid() != 0:
        return "no chromium on PATH, and apt-get needs root"
    try:
        for cmd in (("apt-get", "update", "-q"), APT_INSTALL):
            done = _apt(*cmd)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
                return f"`{' '.join(cmd)}` exited {done.returncode}: {tail[0][:200]}"
    except subprocess.TimeoutExpired as e:
        return f"`{' '.join(e.cmd)}` took over {INSTALL_TIMEOUT_S} s"
    return "apt-get installed chromium but no chromium binary is on PATH"


class Browser:
    def __init__(self, proc: subprocess.Popen, to_chrome: int, from_chrome: int) -> None:
        self.proc, self._w, self._r = proc, to_chrome, from_chrome
        self._buf = b""
        self._next = 0
        self.events: list[dict] = []
        self.session: str | None = None

    @classmethod
    def launch(cls, profile: Path, width: int = 1400, height: int = 900, binary: str | None = None) -> "Browser":
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError("no chromium binary on PATH")
        cmd_r, cmd_w = os.pipe()  # we write commands, chromium reads them on fd 3
        ev_r, ev_w = os.pipe()  # chromium writes on fd 4, we read
        # move chromium's ends out of the way of 3 and 4 before placing them there in the child
        hi_r, hi_w = os.dup(cmd_r), os.dup(ev_w)
        while hi_r < 5 or hi_w < 5:
            hi_r, hi_w = os.dup(hi_r), os.dup(hi_w)

        def place() -> None:
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=place, close_fds=False)  # Python's own fds are not inheritable (PEP 446)
        for fd in (cmd_r, ev_w, hi_r, hi_w):
            os.close(fd)
        b = cls(proc, cmd_w, ev_r)
        try:
            targets = b.call("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            b.session = b.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            b.call("Page.enable")
            b.call("Runtime.enable")
            b.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        except BaseException:
            b.close()
            raise
        return b

    # -- protocol -------------------------------------------------------------------------------------
    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise BrowserError(f"no message from chromium within {timeout:g} s")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed its pipe (exit code {self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, timeout: float = 60.0, session: bool = True, **params: Any) -> dict:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session and self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60.0) -> dict:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        while True:
            ev = self._read(timeout)
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    # -- what the tests use ---------------------------------------------------------------------------
    def open(self, path: Path, timeout: float = 60.0) -> None:
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.call("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait_event("Page.loadEventFired", timeout)

    def eval(self, expression: str, timeout: float = 60.0) -> Any:
        """The value of a JS expression (a promise is awaited); a thrown exception is a BrowserError."""
        res = self.call("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                        returnByValue=True)
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            raise BrowserError(f"page script threw: {d.get('exception', {}).get('description') or d.get('text')}")
        return res["result"].get("value")

    def errors(self) -> list[str]:
        """The page's uncaught exceptions and console.error calls seen so far."""
        out = []
        for ev in self.events:
            params = ev.get("params") or {}
            if ev.get("method") == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails") or {}
                out.append((d.get("exception") or {}).get("description") or d.get("text") or "exception")
            elif ev.get("method") == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args") or []))
        return out

    def screenshot(self, full: bool = False) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if full:
            w, h = self.eval("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": w, "height": min(h, 16000), "scale": 1})
        return base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.call("Browser.close", timeout=5, session=False)
                except (BrowserError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            for fd in (self._w, self._r):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
