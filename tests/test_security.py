"""Only the job's machines get in: CurveZMQ keys, the allowlist, one identity per
connection, nothing readable on the wire. Real servers, real sockets, real handshakes."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import zmq.auth
from live import wait_until
from prometheus_client.parser import text_string_to_metric_families
from zmq.utils import z85

from stella import BadRequest, Client, Unauthorised, _session
from stella.cli import main as stella_main
from stella.status import rates, render
from stella_ps.errors import ConfigError
from stella_ps.process import free_port
from stella_ps.security import fingerprint, load_server_keys, write_keyset

SGD1 = {"name": "sgd", "lr": 1.0}
SECRET_NAME = "layer_secret_weight_name_7f3a"


def _train_one_step(c: Client, version: int) -> int:
    c.push({SECRET_NAME: (np.array([1, 3], np.int32), np.array([0.5, -0.5], np.float32))}, version)
    return c.pull(version, wait_for=version + 1).version


@pytest.fixture
def two_keys(tmp_path):
    """A key set with two allowed clients, a and b."""
    return write_keyset(str(tmp_path / "keys"), clients=("a", "b"))


def _server_args(keys) -> list[str]:
    return ["--keys", keys.server_secret, "--allow", keys.allowlist]


def _client(srv, keys, name: str, **kw) -> Client:
    kw.setdefault("timeout", 10.0)
    return Client(srv.endpoint, server_key=keys.server_public, client_key=keys.client_secrets[name], **kw)


def test_an_unknown_key_gets_nothing_while_an_allowed_one_trains(make_server, curve_keys):
    srv = make_server(1)
    good = Client(srv.endpoint, timeout=10)
    good.register({SECRET_NAME: np.zeros(8, np.float32)}, SGD1)
    version = good.pull(None).version
    outsider = curve_keys.client_secrets["outsider"]  # a real key pair, not on the allowlist
    try:
        # the refusal comes with the handshake; the timeouts only bound a hang
        with pytest.raises(Unauthorised):
            Client(srv.endpoint, timeout=30, client_key=outsider)  # join
        c = Client(srv.endpoint, timeout=30, client_key=outsider, join=False)
        try:
            for call in (c.status, lambda: c.join()):
                with pytest.raises(Unauthorised):
                    call()
            c.worker_id, c.layout, c._index = 0, good.layout, good._index  # pose as worker 0
            c.flat, c.parts, c._part_specs = good.flat, good.parts, good._part_specs
            for call in (lambda: c.register({SECRET_NAME: np.zeros(8, np.float32)}, SGD1),
                         lambda: c.push({SECRET_NAME: np.ones(8, np.float32)}, version), lambda: c.pull(None)):
                with pytest.raises(Unauthorised):
                    call()
        finally:
            c.close(leave=False)
        for _ in range(3):  # and the allowed worker kept training throughout
            version = _train_one_step(good, version)
        assert version == 3 and good.status().workers == [good.worker_id]
        assert "connection refused: key not on the allowlist" in srv.logs()
    finally:
        good.close()


def test_removing_a_key_takes_effect_without_a_restart(make_server, two_keys):
    srv = make_server(2, _server_args(two_keys))
    a, b = _client(srv, two_keys, "a"), _client(srv, two_keys, "b")
    try:
        a.register({SECRET_NAME: np.zeros(8, np.float32)}, SGD1)
        b.register({SECRET_NAME: np.zeros(8, np.float32)})
        b.push({SECRET_NAME: np.ones(8, np.float32)}, 0)
        assert _train_one_step(a, 0) == 1
        with open(two_keys.allowlist) as f:
            lines = f.read().splitlines()
        old_mtime = os.stat(two_keys.allowlist).st_mtime
        with open(two_keys.allowlist, "w") as f:  # take b off the list
            f.write("\n".join(line for line in lines if not line.endswith(" b")) + "\n")
        os.utime(two_keys.allowlist, (old_mtime + 5, old_mtime + 5))
        # the file is looked at on a request at most once a second: the next request, 1.1 s or more
        # after the change (a busy machine only lengthens the sleep), is checked against the new list
        time.sleep(1.1)
        with pytest.raises(Unauthorised, match="no longer on the server's allowlist"):
            b.status()  # b's open connection: refused from now on, and its worker dropped
        assert a.status().workers == [a.worker_id]
        assert _train_one_step(a, 1) == 2  # a trains alone: no step waits for b
        with pytest.raises(Unauthorised):  # and b cannot come back
            _client(srv, two_keys, "b", timeout=30)
        reloads = srv.logs().count('"allowlist reloaded"')
        with open(two_keys.allowlist, "w") as f:  # put b back; SIGHUP (not the clock) reloads it
            f.write("\n".join(lines) + "\n")
        os.utime(two_keys.allowlist, (old_mtime + 5, old_mtime + 5))
        os.kill(srv.pid, signal.SIGHUP)
        # the signal is handled on the server's own time: b's handshake must not race it
        wait_until(lambda: srv.logs().count('"allowlist reloaded"') > reloads, 30, "the reload on SIGHUP")
        b2 = _client(srv, two_keys, "b")
        assert b2.worker_id is not None
        b2.close()
        assert '"allowlist reloaded"' in srv.logs()
    finally:
        a.close()
        b.close(leave=False)


def _refused(url: str) -> dict[str, float]:
    """stella_refused_connections_total by reason, scraped."""
    with urllib.request.urlopen(url, timeout=10) as r:
        fams = text_string_to_metric_families(r.read().decode())
    return {smp.labels["reason"]: smp.value for fam in fams if fam.name == "stella_refused_connections"
            for smp in fam.samples if smp.name.endswith("_total")}


def test_a_refused_key_is_told_at_once_naming_its_fingerprint(make_server, curve_keys, capsys):
    """A key not on the allowlist: the client raises Unauthorised as soon as the server
    refuses the handshake (ZeroMQ's socket monitor sees it), not after its timeout,
    naming the key's fingerprint (the one the server logs) and the allowlist line to
    add; `stella status` says the same; a wrong server key and a client without keys
    are told apart; the server counts every refusal by reason."""
    port = free_port()
    srv = make_server(1, ["--metrics", f"127.0.0.1:{port}"])
    metrics = f"http://127.0.0.1:{port}/metrics"
    assert _refused(metrics) == {"not_allowed": 0, "banned": 0, "handshake": 0}
    outsider = curve_keys.client_secrets["outsider"]
    public = zmq.auth.load_certificate(outsider)[0].decode()
    t0 = time.monotonic()
    with pytest.raises(Unauthorised) as e:
        Client(srv.endpoint, timeout=60, client_key=outsider)
    # told at once (~0.1 s): well before the 60 s timeout, however busy the machine
    assert time.monotonic() - t0 < 30, "waited for a timeout instead of the server's refusal"
    fp = fingerprint(public)
    assert f"fingerprint {fp}" in str(e.value) and f"'{public} <name>'" in str(e.value)
    assert "allowlist" in str(e.value)
    assert f'"key_fingerprint": "{fp}"' in srv.logs()  # the server names the same key
    t0 = time.monotonic()
    assert stella_main(["status", srv.endpoint, "--client-key", outsider, "--timeout", "60"]) == 1
    assert time.monotonic() - t0 < 30 and f"fingerprint {fp}" in capsys.readouterr().err
    # the wrong server key: the server closes the handshake unread, three times in a row
    wrong_server = os.path.join(os.path.dirname(outsider), "server.key")
    t0 = time.monotonic()
    with pytest.raises(Unauthorised, match="STELLA_SERVER_KEY is most likely not that server's public key"):
        Client(srv.endpoint, timeout=60, server_key=wrong_server)
    assert time.monotonic() - t0 < 30  # three handshakes ~1 s apart, not the timeout
    assert _refused(metrics) == {"not_allowed": 2, "banned": 0, "handshake": 3}


def test_a_client_without_keys_is_told_the_server_needs_them(server, monkeypatch):
    monkeypatch.delenv("STELLA_SERVER_KEY")
    monkeypatch.delenv("STELLA_CLIENT_KEY")
    with pytest.raises(Unauthorised, match="requires CurveZMQ keys, and this client has none"):
        Client(server.endpoint, timeout=60)


def test_an_allowlist_replaced_keeping_size_and_time_or_by_sed_i_is_read_again(make_server, two_keys):
    """Editors, `sed -i` and configuration tools replace the file: a new inode, perhaps
    with the old size and modification time; every such replacement is seen."""
    srv = make_server(2, _server_args(two_keys))
    path = two_keys.allowlist
    with open(path) as f:
        lines = f.read().splitlines()
    line_b = next(line for line in lines if line.endswith(" b"))
    b = _client(srv, two_keys, "b")
    try:
        # b's line becomes a comment of the same length, the file keeps its size and time
        st = os.stat(path)
        with open(path + ".new", "w") as f:
            f.write("\n".join("#" * len(line) if line == line_b else line for line in lines) + "\n")
        os.utime(path + ".new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(path + ".new", path)
        assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
        time.sleep(1.1)  # the file is looked at once a second
        with pytest.raises(Unauthorised, match="no longer on the server's allowlist"):
            b.status()
        subprocess.run(["sed", "-i", f"$a {line_b}", path], check=True)  # b back, by sed -i
        time.sleep(1.1)
        b2 = _client(srv, two_keys, "b")
        assert b2.worker_id is not None
        b2.close()
    finally:
        b.close(leave=False)


def test_an_empty_allowlist_starts_with_a_warning(make_server, two_keys, tmp_path):
    empty = tmp_path / "allowlist"
    empty.write_text("# the sites' keys go here\n")
    srv = make_server(1, ["--keys", two_keys.server_secret, "--allow", str(empty)])
    assert "the allowlist is empty: no client can connect" in srv.logs()


def test_an_unreadable_key_names_the_uid_to_give_it_to(monkeypatch, two_keys):
    """Keys are 0600 files; in the images the user is uid 10001, and the error says so."""
    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(zmq.auth, "load_certificate", denied)
    monkeypatch.setattr(os, "geteuid", lambda: 10001)
    with pytest.raises(ConfigError, match=r"runs as uid 10001 .*sudo chown 10001 FILE"):
        load_server_keys(two_keys.server_secret)
    with pytest.raises(ValueError, match=r"runs as uid 10001 .*sudo chown 10001 FILE"):
        _session.curve_keys(two_keys.server_public, two_keys.client_secrets["a"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"runs as uid 1000, .*in the Stella images the user is uid 10001"):
        load_server_keys(two_keys.server_secret)


def test_an_empty_keys_directory_says_what_docker_did(tmp_path):
    """Issue 45: with the host's keys directory missing, Docker mounts an empty one it made, and
    the server looped on "Invalid certificate file"; it now says what happened and what to do
    (a file missing from a folder that holds others keeps the plain error)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    with pytest.raises(ConfigError, match=r"directory is empty: .*Docker mounted an empty one.*stella keygen"):
        load_server_keys(str(keys / "server.key_secret"))
    (keys / "allowlist").write_text("")
    with pytest.raises(ConfigError, match=r"cannot read the server's key pair") as e:
        load_server_keys(str(keys / "server.key_secret"))
    assert "Docker" not in str(e.value)


def test_status_names_each_key_as_the_allowlist_does(server, make_client, curve_keys):
    c = make_client(server.endpoint)
    st = c.status()
    (live,) = st.live
    public = zmq.auth.load_certificate(curve_keys.client_secrets["client"])[0].decode()
    assert live.key_fingerprint == fingerprint(public) and live.key_name == "client"  # the allowlist's comment
    row = render(st, rates(st, None, None)).splitlines()[-1]
    assert f"{fingerprint(public)} client" in row


def test_keygen_of_the_servers_own_key_prints_no_allowlist_line(tmp_path, capsys):
    assert stella_main(["keygen", str(tmp_path), "--name", "server"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "does not go on the allowlist" in err and (tmp_path / "server.key_secret").exists()
    assert stella_main(["keygen", str(tmp_path / "ps"), "--server"]) == 0
    assert (tmp_path / "ps" / "server.key").exists() and capsys.readouterr().out == ""
    assert stella_main(["keygen", str(tmp_path), "--name", "site-a"]) == 0
    assert capsys.readouterr().out.endswith(" site-a\n")


def test_one_connection_holds_one_worker_id(server, make_client):
    a = make_client(server.endpoint)
    wid = a.worker_id
    assert a.join(wid) == wid  # joining again is idempotent
    with pytest.raises(BadRequest, match=r"\[worker_id\] this connection already holds worker id"):
        a.join(wid + 7)
    st = a.status()
    assert st.workers == [wid] and len(st.worker_keys[wid]) == 16  # the key's fingerprint
    assert st.insecure is False


class _Relay:
    """A TCP relay on loopback that keeps every byte it forwards (both directions)."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            self._socks += [conn, up]
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                with self._lock:
                    self.captured += data
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def _capture(srv, **client_kw) -> bytes:
    relay = _Relay(int(srv.endpoint.rsplit(":", 1)[1]))
    try:
        c = Client(f"tcp://127.0.0.1:{relay.port}", timeout=10, **client_kw)
        try:
            c.register({SECRET_NAME: np.arange(8, dtype=np.float32)}, SGD1)
            _train_one_step(c, 0)
            c.status()
        finally:
            c.close()
        with relay._lock:
            return bytes(relay.captured)
    finally:
        relay.close()


PLAINTEXT_MARKERS = [SECRET_NAME.encode(), b"register", b"tensors", b"proto", b"optimizer", b"push_ok"]


def test_the_wire_carries_no_names_and_no_header_plaintext(make_server, monkeypatch):
    captured = _capture(make_server(1))
    assert len(captured) > 1000
    assert not [m for m in PLAINTEXT_MARKERS if m in captured]
    # the same exchange in plaintext shows them all: the check above can fail
    monkeypatch.delenv("STELLA_SERVER_KEY")
    monkeypatch.delenv("STELLA_CLIENT_KEY")
    plain = _capture(make_server(1, ["--insecure"], env={"STELLA_PS_KEYS": "", "STELLA_PS_ALLOW": ""}))
    assert all(m in plain for m in PLAINTEXT_MARKERS)


def test_insecure_is_explicit_and_says_so(make_server, monkeypatch):
    env = dict(os.environ, STELLA_PS_KEYS="", STELLA_PS_ALLOW="")
    refused = subprocess.run([sys.executable, "-m", "stella_ps", "--bind", "tcp://127.0.0.1:0"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--insecure" in refused.stderr and "stella keygen" in refused.stderr
    srv = make_server(1, ["--insecure"], env={"STELLA_PS_KEYS": "", "STELLA_PS_ALLOW": ""})
    assert "INSECURE: no encryption and no authentication" in srv.logs()
    monkeypatch.delenv("STELLA_SERVER_KEY")
    monkeypatch.delenv("STELLA_CLIENT_KEY")
    with Client(srv.endpoint, timeout=10, join=False) as c:
        assert c.status().insecure is True


def test_keygen_files_run_a_secure_job(tmp_path, make_server):
    """The operator's path: `stella keygen` for the server and a worker, the worker's
    printed line on the allowlist, then train."""
    def keygen(name: str) -> str:
        out = subprocess.run([sys.executable, "-m", "stella.cli", "keygen", str(tmp_path), "--name", name],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.strip()

    keygen("server")
    line = keygen("worker1")
    assert line.endswith(" worker1") and len(line.split()[0]) == 40
    assert oct(os.stat(tmp_path / "worker1.key_secret").st_mode & 0o777) == "0o600"
    (tmp_path / "allowlist").write_text(f"# site A\n{line}\n")
    srv = make_server(1, ["--keys", str(tmp_path / "server.key_secret"), "--allow", str(tmp_path / "allowlist")])
    with Client(srv.endpoint, timeout=10, server_key=str(tmp_path / "server.key"),
                client_key=str(tmp_path / "worker1.key_secret")) as c:
        c.register({SECRET_NAME: np.zeros(8, np.float32)}, SGD1)
        assert _train_one_step(c, 0) == 1
    again = subprocess.run([sys.executable, "-m", "stella.cli", "keygen", str(tmp_path), "--name", "worker1"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "not overwriting" in again.stderr


def test_a_keyless_client_whose_handshakes_are_closed_silently_is_told_the_server_needs_keys():
    """libzmq reports a plaintext client's mechanism mismatch as a failed protocol, or, when
    the server closes first, as a handshake closed without detail: both say keys are needed
    (the second once seemed impossible, and an assertion failed in CI)."""
    from stella._session import _Handshakes

    h = object.__new__(_Handshakes)
    h.address, h.keys, h._silent = "tcp://127.0.0.1:5555", None, 3
    assert "requires CurveZMQ keys, and this client has none" in h._silent_server()
    assert h._silent_server() == h._protocol(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)


def test_the_zap_handler_answers_only_well_formed_curve_requests_for_its_domain(two_keys):
    """RFC 27 by hand: 200 with the Z85 key as user id (the server reads it back as a
    message's User-Id) for an allowed key; 400 for a refused key, another domain, another
    mechanism, a malformed request; refusals counted."""
    from stella_ps.security import ZAP_DOMAIN, Allowlist, Gatekeeper

    refused: list[str] = []
    gate = Gatekeeper(zmq.Context.instance(), Allowlist(two_keys.allowlist), refused.append)
    a_public = zmq.auth.load_certificate(two_keys.client_secrets["a"])[0]
    stranger = zmq.curve_keypair()[0]

    def ask(*, domain=None, mechanism=b"CURVE", creds=None, version=b"1.0"):
        creds = [z85.decode(a_public)] if creds is None else creds
        domain = ZAP_DOMAIN.encode() if domain is None else domain
        return gate.answer([version, b"id7", domain, b"127.0.0.1", b"", mechanism, *creds])

    assert ask() == [b"1.0", b"id7", b"200", b"OK", a_public, b""]
    assert ask(creds=[z85.decode(stranger)])[2:5] == [b"400", b"key refused", b""]
    assert refused == ["not_allowed"]
    assert ask(domain=b"other")[2] == b"400"
    assert ask(mechanism=b"PLAIN", creds=[b"user", b"pw"])[2] == b"400"
    assert ask(creds=[b"short"])[2] == b"400"
    assert ask(version=b"2.0")[2] == b"400"
    assert gate.answer([b"1.0"])[1:3] == [b"", b"400"]
    assert refused == ["not_allowed"]  # only a key the allowlist refused counts as refused


def test_a_server_stopped_in_the_loop_iteration_it_started_in_exits_cleanly(two_keys):
    """A SIGTERM that arrives while stella-ps is still starting (CI: SIGSTOP right after the
    ready-file, then SIGCONT + SIGTERM) stops it in the loop iteration whose callbacks add
    the ZAP socket's reader. The reader must go before the socket closes: pyzmq's asyncio
    authenticator left it queued, libzmq's reaper closed the descriptor, and uvloop aborted
    the process (30 of these in one process aborted it every time in 5 runs)."""
    script = f"""
import asyncio, uvloop
from stella_ps.daemon import parse_args
from stella_ps.server import ParameterServer

async def main():
    for _ in range(30):
        s = ParameterServer(parse_args(["--bind", "tcp://127.0.0.1:0", "--keys", {two_keys.server_secret!r},
                                        "--allow", {two_keys.allowlist!r}]))
        await s.start()
        task = asyncio.ensure_future(s.serve())
        s.stop()
        await task
    print("stopped 30 times")

uvloop.run(main())
"""
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "stopped 30 times" in done.stdout, done.stderr[-3000:]
