"""A job answers only its own processes: Horovod's HTTP servers (horovod.run's KVStore behind
fit(), the Gloo rendezvous of horovodrun and of Spark's tasks) refuse every request the job's
key did not sign, listen only where the ranks reach them, and a job's secrets stay off every
command line. Attacked for real, from another process (tests/intruder.py), while real jobs
run; each refused request would have run code (a pickle that touches a marker file) or
ended or misled a rendezvous."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from horovod.runner.http import http_auth
from horovod.runner.http.http_client import put_data_into_kvstore, read_data_from_kvstore
from horovod.runner.http.http_server import KVStoreServer, RendezvousServer

from .hosts import SSH_PORT, SUBNET, Hosts, assert_ranks_numbered_by_host, needs_namespaces
from .intruder import attack_http, attack_wire, evil_payloads, sockets, tree
from .jobs import (
    BIN,
    REPO,
    LiveJob,
    demo_file,
    horovodrun_command,
    metrics,
    processes_naming,
    run,
    weights,
)

KEY = bytes(range(32))


@pytest.fixture
def kvstore() -> tuple[KVStoreServer, int]:
    server = KVStoreServer(verbose=0, key=KEY)
    port = server.start_server(address="127.0.0.1")
    yield server, port
    server.shutdown_server()


def signed(method: str, port: int, path: str, body: bytes, key: bytes = KEY) -> str:
    return http_auth.Signer(key).request(method, port, path, body)[0]


def send(port: int, method: str, path: str, body: bytes, header: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request(method, path, body=body or None, headers={http_auth.AUTH_HEADER: header})
    status = connection.getresponse().status
    connection.close()
    return status


def test_the_kvstore_refuses_every_request_its_key_did_not_sign(
    kvstore: tuple[KVStoreServer, int], tmp_path: Path
) -> None:
    """Before the signed-rendezvous patch each of these PUTs was stored and unpickled by the
    next reader (the launcher, or every rank): code from the network ran."""
    _, port = kvstore
    put_data_into_kvstore("127.0.0.1", port, "runfunc", "func", "the job's", auth_key=KEY)
    marker = tmp_path / "ran"
    statuses = attack_http("127.0.0.1", port, marker)
    assert set(statuses) == {403, 501}, statuses  # 501: HEAD is no method of the store
    assert read_data_from_kvstore("127.0.0.1", port, "runfunc", "func", auth_key=KEY) == (
        "the job's"
    )
    with pytest.raises(RuntimeError):  # another key is another job's
        read_data_from_kvstore("127.0.0.1", port, "runfunc", "func", auth_key=bytes(32))
    assert not marker.exists()


def test_a_signed_request_counts_once_and_only_with_its_own_body(
    kvstore: tuple[KVStoreServer, int], tmp_path: Path
) -> None:
    """An on-path attacker who saw a signed request can neither send it again (a DELETE
    twice would end a rendezvous scope early) nor put another body under its signature (a
    signature's counter is spent once it is seen: the request it signed cannot come after)."""
    _, port = kvstore
    body = evil_payloads(tmp_path / "ran")[1]
    assert send(port, "PUT", "/scope/key", body, signed("PUT", port, "/scope/key", b"")) == 403
    header = signed("PUT", port, "/scope/key", b"harmless")
    assert send(port, "PUT", "/scope/key", b"harmless", header) == 200
    assert send(port, "PUT", "/scope/key", b"harmless", header) == 403  # replayed
    other_port = signed("GET", port + 1, "/scope/key", b"")
    assert send(port, "GET", "/scope/key", b"", other_port) == 403  # made for another server


def test_an_answer_the_server_did_not_sign_is_never_unpickled(tmp_path: Path) -> None:
    """A process that answers on a job's port in its place (a forged rank result, a forged
    function for the ranks): the client refuses the answer before unpickling it."""
    marker = tmp_path / "ran"
    payload = evil_payloads(marker)[1]

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header(http_auth.AUTH_HEADER, "0" * 64)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_: object) -> None:
            pass

    impostor = http.server.HTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.handle_request, daemon=True).start()
    with pytest.raises(RuntimeError, match="not authenticated"):
        read_data_from_kvstore("127.0.0.1", impostor.server_address[1], "runfunc", "func",
                               auth_key=KEY)  # fmt: skip
    impostor.server_close()
    assert not marker.exists()


def test_the_rendezvous_counts_a_ranks_finish_once_and_listens_where_it_was_told() -> None:
    server = RendezvousServer(key=KEY)
    port = server.start(address="127.0.0.1")
    try:
        listening = {(ip, p) for kind, ip, p in sockets(tree(os.getpid())) if p == port}
        assert listening == {("127.0.0.1", port)}
        with pytest.raises(OSError):  # not on the machine's other addresses
            http.client.HTTPConnection(_non_loopback_address(), port, timeout=2).connect()
    finally:
        server.stop()


def _non_loopback_address() -> str:
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == 2 and not address.address.startswith("127."):
                return address.address
    pytest.skip("this machine has no address besides loopback")


FIT = """
import sys, hvd_cpu, pandas as pd
frame = pd.read_parquet(sys.argv[1])
hvd_cpu.fit(frame, np=2, epochs=int(sys.argv[3]), batch_size=16, output=sys.argv[2], quiet=True)
"""


def test_fit_under_attack_trains_as_undisturbed_and_listens_on_loopback_only(
    tmp_path: Path,
) -> None:
    """hvd_cpu.fit() on one machine: while it trains, another process finds every socket of
    its process tree and sends each what a stranger can (tests/intruder.py): pickles that
    would run code, DELETEs that would end a rendezvous scope, forged results. Nothing it
    sent runs or changes the result, and every socket is on loopback."""
    data = demo_file(tmp_path / "frame.parquet", rows=2048)
    marker = tmp_path / "ran"
    attacked = subprocess.Popen(
        [sys.executable, "-c", FIT, str(data), str(tmp_path / "attacked"), "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: set[tuple[str, str, int]] = set()
    answered: dict[int, set[int]] = {}  # port: the HTTP statuses it answered
    while attacked.poll() is None:
        found = sockets(tree(attacked.pid))
        seen |= set(found)
        for kind, _, port in found:
            if kind == "tcp":
                answered.setdefault(port, set()).update(attack_http("127.0.0.1", port, marker))
        time.sleep(0.2)
    output = attacked.stdout.read()
    assert attacked.returncode == 0, output
    servers = {port for port, statuses in answered.items() if 403 in statuses}
    assert len(servers) >= 2, f"the KVStore and the rendezvous were not both attacked: {answered}"
    assert all(200 not in statuses for statuses in answered.values()), answered
    assert not marker.exists(), "code sent by another process ran"
    assert {ip for _, ip, _ in seen} == {"127.0.0.1"}, seen
    quiet = run([sys.executable, "-c", FIT, str(data), str(tmp_path / "quiet"), "3"])
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    for name, value in weights(tmp_path / "quiet").items():
        assert torch.equal(weights(tmp_path / "attacked")[name], value), name


def command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
    return lines


NOBODY_TRIES = """
import sys
for path in sys.argv[1:]:
    try:
        open(path, 'rb').read(1)
        print('opened', path)
    except OSError:
        pass
"""


@pytest.mark.slow
def test_no_secret_on_a_command_line_nor_readable_by_another_user(tmp_path: Path) -> None:
    """horovodrun --gloo -np 2 with a token exported (a cloud or MLflow token): while the job
    runs, no process's command line holds the token or the job's key (Horovod's launcher ran
    each rank as `sh -c "env K=V ... command"`), and another user can read neither a rank's
    environment nor its shared-memory segment."""
    token = "hvd-cpu-test-token-" + os.urandom(8).hex()
    data = demo_file(tmp_path / "frame.parquet", rows=20_000)
    output = tmp_path / "out"
    job = LiveJob(
        [*horovodrun_command(2), "train", "--data", str(data), "--epochs", "60", "--output",
         str(output)],
        env={"CLOUD_TOKEN": token},
    )  # fmt: skip
    job.wait_for(r"Epoch 2:", 120)
    ranks = rank_processes(output)
    assert len(ranks) == 2, job.summary()
    key = _environ(ranks[0])["HOROVOD_JOB_KEY"]
    assert _environ(ranks[1])["HOROVOD_JOB_KEY"] == key and len(key) == 64
    leaks = [line for line in command_lines() if token in line or key in line]
    segments = [str(p) for p in Path("/dev/shm").iterdir() if p.is_file()]
    as_nobody = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         NOBODY_TRIES, *[f"/proc/{p}/environ" for p in ranks], *segments],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert job.finish(300) == 0, job.summary()
    assert leaks == []
    assert as_nobody.returncode == 0, as_nobody.stderr
    assert as_nobody.stdout == "", as_nobody.stdout


def rank_processes(output: Path) -> list[int]:
    """The rank processes (Python, not the shells that start them) of the job writing to
    `output`."""
    return [
        pid
        for pid in processes_naming(output)
        if "HOROVOD_RANK" in _environ(pid) and "python" in Path(f"/proc/{pid}/exe").resolve().name
    ]


def _environ(pid: int) -> dict[str, str]:
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


LATE_RANK = """
import os, time, torch, horovod.torch as hvd
if os.environ["HOROVOD_RANK"] == "1":
    time.sleep(4)  # rank 0's Gloo pairs listen meanwhile, for anyone who comes
hvd.init()
print("sum", hvd.allreduce(torch.full((3,), hvd.rank() + 1.0), op=hvd.Sum).tolist(), flush=True)
"""


def test_a_stranger_at_a_gloo_pairs_port_neither_takes_the_ranks_place_nor_ends_the_job(
    tmp_path: Path,
) -> None:
    """Gloo's TCP pair accepted the first connection that came as its peer: a stranger who
    connected to a rank's listening port while its peer was still starting took the peer's
    place (the rank was then refused, `connect ... Connection refused`, and the job aborted;
    or the stranger fed the collectives). Now a connection must prove the job's key first:
    the stranger's are closed, one that says nothing among them, and the sum is right."""
    script = tmp_path / "late.py"
    script.write_text(LATE_RANK)
    job = LiveJob([*horovodrun_command(2, program=(sys.executable,)), str(script)])
    held: list[socket.socket] = []
    tried: set[tuple[str, int]] = set()
    while job.process.poll() is None:
        for kind, ip, port in sockets(tree(job.process.pid)):
            if kind == "tcp" and (ip, port) not in tried:
                tried.add((ip, port))
                for hello in (b"", b"GET / HTTP/1.0\r\n\r\n" * 4, bytes(64)):
                    with contextlib.suppress(OSError):  # it may have connected meanwhile
                        stranger = socket.create_connection((ip, port), timeout=2)
                        stranger.sendall(hello)
                        held.append(stranger)  # held open: a silent one proves nothing
        time.sleep(0.01)
    assert job.finish(60) == 0, job.summary()
    for stranger in held:
        stranger.close()
    assert len(tried) > 1, f"only the rendezvous was seen, no Gloo listener: {tried}"
    assert job.output.count("sum [3.0, 3.0, 3.0]") == 2, job.summary()


@pytest.mark.slow
def test_an_elastic_job_under_attack_trains_as_a_plain_one(tmp_path: Path) -> None:
    """launch/elastic.sh: horovodrun's elastic rendezvous unpickled the worker addresses any
    process PUT (`/worker_addresses/HOST:SLOT`), and handed each worker's notification key to
    anyone who asked; each worker's notification service read whatever length it was sent.
    Attacked throughout, the job trains as a plain one does and no code of the attacker's runs."""
    plain = run([*horovodrun_command(2), "train", "--epochs", "3", "--output",
                 str(tmp_path / "plain")])  # fmt: skip
    assert plain.returncode == 0, plain.stdout + plain.stderr
    marker = tmp_path / "ran"
    job = LiveJob(
        [str(REPO / "launch" / "elastic.sh"), "--epochs", "3", "--output",
         str(tmp_path / "elastic")],
        env={"HVD_CPU_VENV": str(BIN.parent), "NP": "2"},
    )  # fmt: skip
    answered: set[int] = set()
    while job.process.poll() is None:
        for kind, ip, port in sockets(tree(job.process.pid)):
            if kind == "tcp":
                answered.update(attack_http(ip, port, marker))
                attack_wire(ip, port)
        time.sleep(0.1)
    assert job.finish(60) == 0, job.summary()
    assert 403 in answered and 200 not in answered, answered
    assert not marker.exists(), "code sent by another process ran"
    assert [m["world_size"] for m in metrics(tmp_path / "elastic")] == [2, 2, 2]
    for name, value in weights(tmp_path / "plain").items():
        # not bit-identical: an elastic rank fits the feature statistics on its own
        torch.testing.assert_close(weights(tmp_path / "elastic")[name], value, rtol=0, atol=1e-6)


@needs_namespaces
@pytest.mark.slow
def test_across_two_hosts_no_secret_on_a_command_line_and_a_stranger_host_is_refused(
    tmp_path: Path,
) -> None:
    """horovodrun over two namespace hosts: its ssh command lines carried every exported
    variable (`ssh HOST 'cd ...; env K=V ... command'`, readable on both hosts for the whole
    job) and `task_fn`'s pickled settings with their key. Now both go on ssh's standard input.
    And from the second host, a stranger's requests to the launcher's rendezvous are refused."""
    token = "hvd-cpu-test-token-" + os.urandom(8).hex()
    marker = tmp_path / "ran"
    (tmp_path / "hosts").mkdir()
    with Hosts(tmp_path / "hosts", ["hvdsafea", "hvdsafeb"]) as hosts:
        launcher = ("--hostfile", str(hosts.hostfile(2)), "-p", str(SSH_PORT), "-i",
                    str(hosts.key))  # fmt: skip
        output = hosts.local / "out"
        job = LiveJob(
            [*horovodrun_command(4, launcher=launcher), "train", "--epochs", "40",
             "--output", str(output)],
            env={"CLOUD_TOKEN": token},
        )  # fmt: skip
        job.wait_for(r"Epoch 2:", 180)
        pids = rank_processes(output)
        keys = {_environ(p).get("HOROVOD_JOB_KEY") for p in pids}
        leaks = [line for line in command_lines() if token in line or any(k in line for k in keys)]
        ports = [p for _, ip, p in sockets(tree(job.process.pid)) if ip == f"{SUBNET}.1"]
        stranger = subprocess.run(
            hosts.hosts[1].exec(sys.executable, "-m", "tests.intruder", str(marker),
                                *[f"{SUBNET}.1:{p}" for p in ports]),
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        assert job.finish(300) == 0, job.summary()
        written = hosts.hosts[0].path(output)  # on rank 0's host
        report = json.loads((written / "ranks.json").read_text())
    assert_ranks_numbered_by_host(report, ["hvdsafea", "hvdsafeb"], 2)
    assert {r["transport"] for r in report} == {"shared memory"}
    assert len(pids) == 4 and len(keys) == 1 and None not in keys, keys
    assert leaks == []
    assert ports, "the launcher listened on no address of the hosts' network"
    said = stranger.stdout.split()
    assert stranger.returncode == 0 and "403" in said and "200" not in said, stranger
    assert not marker.exists()
