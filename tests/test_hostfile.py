"""Host files: one reader (hvd_cpu.tools.hostfile) for doctor and the launch scripts, so a bad file
is the same one line and exit code 2 from each of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvd_cpu.errors import InputError
from hvd_cpu.tools.hostfile import HostSlots, main, parse, read_hostfile

from .jobs import BIN, REPO, run

LAUNCH = REPO / "launch"
COMMENTED = """\
# the cluster
node1 slots=4   # the big one

node2
  10.0.0.3\tslots=2
"""


def test_hosts_slots_comments_and_blank_lines() -> None:
    assert parse(COMMENTED, "hosts") == [
        HostSlots("node1", 4),
        HostSlots("node2", 1),
        HostSlots("10.0.0.3", 2),
    ]


def test_the_example_host_file_reads() -> None:
    assert read_hostfile(LAUNCH / "hostfile.example") == [
        HostSlots("node1", 4),
        HostSlots("node2", 4),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=abc\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots=abc'"),
        ("a slots=0\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots=0'"),
        ("a slots=-1\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots=-1'"),
        ("a slots=²\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots=²'"),
        ("a slots=\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots='"),
        ("a max_slots=4\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a max_slots=4'"),
        ("a slots=2 slots=3\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots=2 "
         "slots=3'"),
        ("a slots = 2\n", "hosts:1: expected 'host slots=N' with N >= 1, got 'a slots = 2'"),
        ("a slots=2\n\nb\na slots=1 # again\n", "hosts:4: a is listed again (first on line 1); "
         "give each host one line with all its slots"),
        ("me@a slots=2\n", "hosts:1: 'me@a' is not a host name or IPv4 address: letters, "
         "digits, '.', '-' and '_' only (horovodrun takes no user@ or :port in a host)"),
        ("a:22\n", "hosts:1: 'a:22' is not a host name or IPv4 address: letters, digits, '.', "
         "'-' and '_' only (horovodrun takes no user@ or :port in a host)"),
        ("# nobody\n\n", "hosts lists no hosts; expected 'host slots=N' lines (N >= 1, slots=1 "
         "if omitted), # for comments"),
        ("", "hosts lists no hosts; expected 'host slots=N' lines (N >= 1, slots=1 if omitted), "
         "# for comments"),
    ],
    ids=["slots=abc", "slots=0", "negative", "superscript", "empty slots", "other key",
         "slots twice", "spaced", "duplicate host", "user@", "port", "only comments", "empty"],
)  # fmt: skip
def test_bad_host_files_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(InputError) as raised:
        parse(text, "hosts")
    assert str(raised.value) == message


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^host file not found: .*absent$"):
        read_hostfile(tmp_path / "absent")
    (tmp_path / "binary").write_bytes(bytes(range(256)))
    with pytest.raises(InputError, match=r"binary is not a text file of 'host slots=N' lines"):
        read_hostfile(tmp_path / "binary")


@pytest.mark.parametrize(
    ("form", "printed"),
    [("total", "7\n"), ("hosts", "node1:4,node2:1,10.0.0.3:2\n"),
     ("discovery", "node1:4\nnode2:1\n10.0.0.3:2\n")],
)  # fmt: skip
def test_the_forms_the_launch_scripts_read(
    form: str, printed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hosts").write_text(COMMENTED)
    assert main([form, str(tmp_path / "hosts")]) == 0
    assert capsys.readouterr() == (printed, "")


def test_a_bad_call_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sum", "hosts"]) == 2
    assert capsys.readouterr().err == (
        "usage: python -m hvd_cpu.tools.hostfile total|hosts|discovery FILE\n"
    )


def fake_venv(folder: Path) -> Path:
    """A venv whose python is the real one and whose horovodrun only prints its arguments:
    run-hosts.sh goes as far as starting the job, and no job starts."""
    (folder / "bin").mkdir(parents=True)
    for name, body in [("python", f'exec {BIN / "python"} "$@"'), ("horovodrun", 'echo "$@"')]:
        (folder / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / "bin" / name).chmod(0o755)
    return folder


def test_run_hosts_gives_horovodrun_the_hosts_it_reads(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text(COMMENTED)
    venv = fake_venv(tmp_path / "venv")
    script = [str(LAUNCH / "run-hosts.sh"), str(tmp_path / "hosts"), "--epochs", "1"]
    job = run(script, env={"HVD_CPU_VENV": str(venv)})
    assert (job.returncode, job.stderr) == (0, "")
    assert job.stdout.split() == [
        "--gloo", "-np", "7", "-H", "node1:4,node2:1,10.0.0.3:2", "--start-timeout", "30",
        "hvd-cpu", "train", "--epochs", "1",
    ]  # fmt: skip


def test_discover_hosts_lists_what_it_reads(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text(COMMENTED)
    env = {"HVD_CPU_HOSTFILE": str(tmp_path / "hosts"), "HVD_CPU_VENV": str(BIN.parent)}
    job = run([str(LAUNCH / "discover-hosts.sh")], env=env)
    assert (job.returncode, job.stdout, job.stderr) == (0, "node1:4\nnode2:1\n10.0.0.3:2\n", "")


@pytest.mark.parametrize("how", ["run-hosts.sh", "discover-hosts.sh", "elastic.sh", "doctor"])
def test_a_bad_host_file_is_the_same_line_everywhere(how: str, tmp_path: Path) -> None:
    """The awk these scripts had counted slots=abc as 0 slots; now each stops, before any
    launch, with the line doctor prints."""
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=4\nnode2 slots=abc\n")
    venv = {"HVD_CPU_VENV": str(fake_venv(tmp_path / "venv"))}
    commands = {
        "run-hosts.sh": ([str(LAUNCH / "run-hosts.sh"), str(hosts)], venv),
        "discover-hosts.sh": ([str(LAUNCH / "discover-hosts.sh")], venv),
        "elastic.sh": ([str(LAUNCH / "elastic.sh")], venv),
        "doctor": ([str(BIN / "hvd-cpu"), "doctor", "--hostfile", str(hosts)], {}),
    }
    command, env = commands[how]
    job = run(command, env={**env, "HVD_CPU_HOSTFILE": str(hosts)})
    assert (job.returncode, job.stdout) == (2, "")
    assert job.stderr.splitlines() == [
        f"hvd-cpu: error: {hosts}:2: expected 'host slots=N' with N >= 1, got 'node2 slots=abc'"
    ]
