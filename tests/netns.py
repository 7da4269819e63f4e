"""Several "hosts" on one machine: network namespaces on a bridge, with names, processes and faults.

No pytest in here, so a script can use it too. A :class:`Topology` builds, as root::

    switch namespace <prefix>-sw      bridge br0
      veth <prefix>-v<I>  <-->  eth0 in host namespace <prefix>-h<I>, address 10.200.<S>.<10+I>/24

Every name starts with a per-run prefix (``gc<pid><letters>``), so parallel runs never collide, and
no address is ever configured in the root namespace. ``/etc/netns/<ns>/hosts`` makes names such as
``job-0.svc`` resolve inside each host (``ip netns exec`` bind-mounts it over ``/etc/hosts``).

Faults: :meth:`Topology.link_down` / :meth:`~Topology.link_up` (the switch port), a silent
:meth:`~Topology.partition` (nftables, policy drop), random :meth:`~Topology.loss` (nftables numgen),
:meth:`~Topology.delay` (an iptables NFQUEUE rule plus ``tests/netdelay.py``), removing and adding a
hosts entry, and :meth:`~Topology.kill9` of a process inside one of the topology's namespaces.

Cleanup (:meth:`Topology.close`, also on ``with``-exit, also after a failed build) kills every
process the topology started, by PID, deletes its namespaces by name and removes its
``/etc/netns`` folders.

Example::

    with Topology(2).build() as topo:
        server = topo.popen(0, [sys.executable, "-m", "http.server", "8000"])
        topo.run(1, ["python3", "-c", "import urllib.request as u; u.urlopen('http://job-0.svc:8000')"])
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence

NETNS_RUN_DIR = "/run/netns"
NETNS_ETC_DIR = "/etc/netns"
NETDELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netdelay.py")
#: Bound on each setup or teardown command; they take milliseconds.
COMMAND_TIMEOUT_S = 20.0
MAX_HOSTS = 100  # keeps "<prefix>-v<I>" within the kernel's 15-character interface names
IFNAMSIZ = 15

_NAME_RE = re.compile(r"^gc(\d+)[a-z]+-(sw|h\d+)$")
_run_counter = itertools.count()
#: Pass as the host index to :meth:`Topology.popen`, :meth:`~Topology.command` or :meth:`~Topology.run`
#: to run in the switch namespace, which plays the node (see :meth:`Topology.node_addr`).
NODE = "node"
_PARTITION_TABLE = "gc_partition"
_LOSS_TABLE = "gc_loss"


class NetnsError(RuntimeError):
    """Raised when a topology command fails; the message quotes the command and its stderr."""


def unusable_reason() -> str | None:
    """Returns why network namespaces cannot be used here, or None when they can.

    Checks root, ``ip``, and that a namespace can really be created (a container without
    CAP_SYS_ADMIN has root and ``ip`` but cannot).
    """
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns add); run as root or in CI"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2's `ip` (apt-get install -y iproute2)"
    probe = f"{_new_prefix()}-h0"
    try:
        _run(["ip", "netns", "add", probe])
    except (NetnsError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    try:
        _run(["ip", "netns", "del", probe])
    except (NetnsError, OSError) as exc:
        return f"created but could not delete the probe namespace {probe}: {exc}"
    return None


def tool_missing(*tools: str) -> str | None:
    """Returns a reason naming the first of ``tools`` that is not installed, or None."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y {_PACKAGE_OF.get(tool, tool)})"
    return None


_PACKAGE_OF = {"ip": "iproute2", "nft": "nftables", "iptables": "iptables", "unshare": "util-linux"}


def netfilterqueue_missing() -> str | None:
    """Returns why the NFQUEUE delayer cannot run here, or None."""
    reason = tool_missing("iptables")
    if reason:
        return reason
    try:
        import netfilterqueue  # noqa: F401
    except ImportError as exc:
        return (f"the PyPI package NetfilterQueue is not importable ({exc}); "
                "apt-get install -y libnetfilter-queue-dev, then pip install NetfilterQueue")
    return None


def _ours(name: str, pid: int | None) -> bool:
    match = _NAME_RE.match(name)
    return match is not None and (pid is None or int(match.group(1)) == pid)


def our_namespaces(pid: int | None = None) -> list[str]:
    """Namespaces named like ours, from ``ip netns list``: those of process ``pid``, or of any run."""
    names = []
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _ours(name, pid):
            names.append(name)
    return sorted(names)


def our_netns_dirs(pid: int | None = None) -> list[str]:
    """Folders under /etc/netns named like ours: those of process ``pid``, or of any run."""
    if not os.path.isdir(NETNS_ETC_DIR):
        return []
    return sorted(d for d in os.listdir(NETNS_ETC_DIR) if _ours(d, pid))


def root_links(pid: int | None = None) -> list[str]:
    """Interfaces in the root namespace named like ours (there should never be any: every veth is
    created inside the switch namespace)."""
    out = _run(["ip", "-o", "link", "show"]).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    prefix = "gc" if pid is None else f"gc{pid}"
    return [n for n in names if re.match(rf"^{prefix}[a-z]+-v\d+$", n)]


def remove_stale() -> list[str]:
    """Deletes namespaces and /etc/netns folders left by runs whose process is gone (a crash or
    SIGKILL skips cleanup). Names of live runs are never touched. Returns what was removed."""
    removed = []
    for name in sorted(set(our_namespaces()) | set(our_netns_dirs())):
        match = _NAME_RE.match(name)
        assert match is not None
        if _pid_alive(int(match.group(1))):
            continue
        if os.path.exists(os.path.join(NETNS_RUN_DIR, name)):
            _run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(os.path.join(NETNS_ETC_DIR, name), ignore_errors=True)
        removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_prefix() -> str:
    n = next(_run_counter)
    letters = ""
    while True:
        n, r = divmod(n, 26)
        letters = chr(ord("a") + r) + letters
        if n == 0:
            break
        n -= 1
    return f"gc{os.getpid()}{letters}"


def _run(argv: Sequence[str], *, input: str | None = None, check: bool = True,
         timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {timeout_s} s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _wait_pids_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Waits for processes (not necessarily our children) to exit, through pidfds, so the wait
    ends at the exit event rather than at a polling tick. Returns those still alive."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout_s
    try:
        while fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select(list(fds), [], [], remaining)
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


class HostProcess:
    """A process started inside a host namespace: stdout read line by line with deadlines, stdin
    for commands, stderr kept in a file (so a chatty process never blocks on a full pipe)."""

    def __init__(self, host: int | str, argv: Sequence[str], popen: subprocess.Popen[bytes], stderr_path: str) -> None:
        self.host = host
        self.argv = list(argv)
        self.popen = popen
        self.stderr_path = stderr_path
        self._out = bytearray()
        self._eof = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read_some(self, timeout_s: float) -> bool:
        """Reads what stdout has within ``timeout_s``; False on timeout, True on data or EOF."""
        stdout = self.popen.stdout
        if self._eof or stdout is None:
            return True
        ready, _, _ = select.select([stdout], [], [], max(0.0, timeout_s))
        if not ready:
            return False
        chunk = os.read(stdout.fileno(), 65536)
        if chunk:
            self._out += chunk
        else:
            self._eof = True
        return True

    def expect_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Waits until a whole stdout line matches ``pattern`` (``re.search``); the lines read on the
        way stay in :meth:`stdout`. Raises TimeoutError, quoting stderr, if none does in time."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        scanned = 0
        while True:
            text = self._out.decode(errors="replace")
            lines = text.split("\n")
            complete = lines if self._eof else lines[:-1]
            for line in complete[scanned:]:
                match = regex.search(line)
                if match:
                    return match
            scanned = len(complete)
            if self._eof:
                raise TimeoutError(f"host {self.host} pid {self.pid} exited (rc {self.popen.poll()}) without printing "
                                   f"a line matching {pattern!r}\nstdout:\n{text[-2000:]}\nstderr:\n{self.stderr()[-3000:]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read_some(remaining):
                raise TimeoutError(f"host {self.host} pid {self.pid}: no line matching {pattern!r} within {timeout_s} s"
                                   f"\nstdout:\n{text[-2000:]}\nstderr:\n{self.stderr()[-3000:]}")

    def write_line(self, text: str) -> None:
        """Sends one line to the process's stdin."""
        assert self.popen.stdin is not None, "started without stdin=PIPE"
        self.popen.stdin.write(text.encode() + b"\n")
        self.popen.stdin.flush()

    def wait(self, timeout_s: float) -> int | None:
        """Reads stdout to EOF and waits for exit within ``timeout_s``; None if it is still running."""
        deadline = time.monotonic() + timeout_s
        while not self._eof:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read_some(remaining):
                return None
        try:
            return self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def stdout(self) -> str:
        return self._out.decode(errors="replace")

    def stderr(self) -> str:
        try:
            with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL by PID (if still running) and reap."""
        if self.popen.poll() is None:
            try:
                self.popen.kill()
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


class Topology:
    """``n_hosts`` namespaces on one bridge. Use as ``with Topology(n).build() as topo: ...``.

    ``names`` maps a host index to the names that resolve to it in every host's /etc/hosts
    (default: ``job-<I>.svc``, ``job-<I>`` and ``job-<I>.gridcomm.default.svc.cluster.local``);
    ``own_names`` maps a host index to names that resolve to it only inside that host (as kubelet
    writes a pod's own host name into the pod's /etc/hosts alone).
    ``setup_s`` and ``teardown_s`` record how long build and close took.
    """

    def __init__(self, n_hosts: int, *, names: Mapping[int, Sequence[str]] | None = None,
                 own_names: Mapping[int, Sequence[str]] | None = None, subnet_octet: int | None = None) -> None:
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts={n_hosts} must be between 1 and {MAX_HOSTS}")
        self.n_hosts = n_hosts
        self.prefix = _new_prefix()
        if len(self.veth(n_hosts - 1)) > IFNAMSIZ:
            raise ValueError(f"prefix {self.prefix!r} makes interface names longer than {IFNAMSIZ} characters")
        # Why: the third octet varies by PID, so a leaked address (there should be none) says which run.
        octet = subnet_octet if subnet_octet is not None else 20 + os.getpid() % 200
        self.subnet = ipaddress.IPv4Network(f"10.200.{octet}.0/24")
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(n_hosts)]
        self.names: dict[int, list[str]] = {
            i: list(names[i]) if names and i in names else
            [f"job-{i}.svc", f"job-{i}", f"job-{i}.gridcomm.default.svc.cluster.local"]
            for i in range(n_hosts)
        }
        self.own_names: dict[int, list[str]] = {i: list(v) for i, v in (own_names or {}).items()}
        self._node_addr: str | None = None
        self._hidden: set[str] = set()
        self._created: list[str] = []
        self._processes: list[HostProcess] = []
        self._delayers: dict[int, tuple[HostProcess, list[str]]] = {}
        self._logdir: str | None = None
        self.setup_s: float | None = None
        self.teardown_s: float | None = None
        self._closed = False

    # ------------------------------------------------------------------ names
    def ns(self, i: int | str) -> str:
        """Host ``i``'s namespace; ``NODE`` names the switch namespace."""
        return self.switch if i == NODE else self.hosts[i]  # type: ignore[index]

    def node_addr(self) -> str:
        """Gives the switch's bridge the subnet's first address and returns it, so a process started
        with ``popen(NODE, ...)`` reaches every host as a Kubernetes node reaches its pods (kubelet's
        probes come from there). Idempotent."""
        if self._node_addr is None:
            addr = str(self.subnet.network_address + 1)
            _run(["ip", "-n", self.switch, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "br0"])
            self._node_addr = addr
        return self._node_addr

    def veth(self, i: int) -> str:
        """The switch-side interface of host ``i`` (lives in the switch namespace)."""
        return f"{self.prefix}-v{i}"

    def addr(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)

    # ------------------------------------------------------------------ build and close
    def build(self) -> Topology:
        """Creates the switch, the hosts, their links and hosts files. On any failure, removes what
        it made and re-raises."""
        started = time.monotonic()
        try:
            self._logdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
            self._add_ns(self.switch)
            sw = ["ip", "-n", self.switch]
            _run([*sw, "link", "add", "br0", "type", "bridge"])
            _run([*sw, "link", "set", "br0", "up"])
            _run([*sw, "link", "set", "lo", "up"])
            for i, host in enumerate(self.hosts):
                self._add_ns(host)
                _run([*sw, "link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", host])
                _run([*sw, "link", "set", self.veth(i), "master", "br0", "up"])
                h = ["ip", "-n", host]
                _run([*h, "link", "set", "lo", "up"])
                _run([*h, "addr", "add", f"{self.addr(i)}/{self.subnet.prefixlen}", "dev", "eth0"])
                _run([*h, "link", "set", "eth0", "up"])
            self._write_hosts_files()
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - started
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        os.makedirs(os.path.join(NETNS_ETC_DIR, name), exist_ok=True)
        # Why: no DNS server is reachable from inside; an explicit empty resolver (glibc then
        # tries 127.0.0.1, refused at once) keeps lookups of unknown names fast and local.
        with open(os.path.join(NETNS_ETC_DIR, name, "resolv.conf"), "w") as f:
            f.write("# gridcomm test namespace: names come from /etc/hosts only\noptions attempts:1 timeout:1\n")

    def close(self) -> None:
        """Kills every process started here (by PID), deletes the namespaces and their /etc/netns
        folders. Idempotent; raises NetnsError after doing all it can if something remained."""
        if self._closed:
            return
        self._closed = True
        started = time.monotonic()
        problems: list[str] = []
        for proc in reversed(self._processes):
            proc.kill()
        # Processes that ours started (grandchildren) still sit in our namespaces: kill those by PID.
        leftover: list[int] = []
        for name in self._created:
            if os.path.exists(os.path.join(NETNS_RUN_DIR, name)):
                pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
                for pid in map(int, pids):
                    try:
                        os.kill(pid, signal.SIGKILL)
                        leftover.append(pid)
                    except ProcessLookupError:
                        pass
        still = _wait_pids_gone(leftover, 10.0)
        if still:
            problems.append(f"processes {still} survived SIGKILL")
        for name in reversed(self._created):
            done = _run(["ip", "netns", "del", name], check=False)
            if done.returncode != 0 and os.path.exists(os.path.join(NETNS_RUN_DIR, name)):
                problems.append(f"ip netns del {name}: {done.stderr.strip()}")
            shutil.rmtree(os.path.join(NETNS_ETC_DIR, name), ignore_errors=True)
        if os.path.isdir(NETNS_ETC_DIR) and not os.listdir(NETNS_ETC_DIR):
            try:
                os.rmdir(NETNS_ETC_DIR)
            except OSError:
                pass  # another run just made its folder there
        if self._logdir:
            shutil.rmtree(self._logdir, ignore_errors=True)
        self.teardown_s = time.monotonic() - started
        if problems:
            raise NetnsError("cleanup of " + self.prefix + " incomplete: " + "; ".join(problems))

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except NetnsError:
            if exc_type is None:
                raise
            # An exception is already on its way out; do not hide it behind the cleanup's.
            print(f"netns: {sys.exc_info()[1]}", file=sys.stderr)

    # ------------------------------------------------------------------ processes
    def command(self, i: int | str, argv: Sequence[str], *, hostname: str | None = None) -> list[str]:
        """The argv that runs ``argv`` inside host ``i`` (with its own UTS namespace and host name
        when ``hostname`` is given). Each step execs the next, so the PID is the command's own."""
        prefix = ["ip", "netns", "exec", self.ns(i)]
        if hostname is not None:
            prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        return prefix + list(argv)

    def popen(self, i: int | str, argv: Sequence[str], *, hostname: str | None = None,
              env: Mapping[str, str] | None = None, stdin: bool = False) -> HostProcess:
        """Starts ``argv`` in host ``i``; it is killed by :meth:`close` if still running."""
        assert self._logdir is not None and not self._closed, "build() the topology first"
        stderr_path = os.path.join(self._logdir, f"h{i}-{len(self._processes)}.stderr")
        with open(stderr_path, "wb") as err:
            popen = subprocess.Popen(
                self.command(i, argv, hostname=hostname), env=dict(env) if env is not None else None,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
            )
        proc = HostProcess(i, argv, popen, stderr_path)
        self._processes.append(proc)
        return proc

    def run(self, i: int | str, argv: Sequence[str], *, input: str | None = None, check: bool = True,
            timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Runs a short command inside host ``i`` and returns its output."""
        return _run(self.command(i, argv), input=input, check=check, timeout_s=timeout_s)

    def host_pids(self, i: int) -> list[int]:
        return [int(p) for p in _run(["ip", "netns", "pids", self.ns(i)]).stdout.split()]

    def kill9(self, pid: int) -> None:
        """SIGKILL ``pid``, which must live in one of this topology's host namespaces (so a wrong
        PID can never hit a process outside the test)."""
        try:
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        except FileNotFoundError:
            raise ProcessLookupError(f"no process {pid}") from None
        except OSError:
            inode = -1  # not even readable: certainly not one of ours
        ours = {os.stat(os.path.join(NETNS_RUN_DIR, h)).st_ino for h in self.hosts}
        if inode not in ours:
            raise PermissionError(f"pid {pid} is not in a namespace of {self.prefix}; refusing to kill it")
        os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ names (DNS)
    def _hosts_text(self, inside: int | None = None) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for i in range(self.n_hosts):
            own = self.own_names.get(i, []) if i == inside else []
            visible = [n for n in dict.fromkeys([*own, *self.names[i]]) if n not in self._hidden]
            if visible:
                lines.append(f"{self.addr(i)}\t{' '.join(visible)}")
        return "\n".join(lines) + "\n"

    def _write_hosts_files(self) -> None:
        for inside, name in [(None, self.switch), *enumerate(self.hosts)]:
            text = self._hosts_text(inside).encode()
            path = os.path.join(NETNS_ETC_DIR, name, "hosts")
            # Why in place (same inode): running processes see /etc/hosts through a bind mount of
            # this very file; replacing it by rename would leave them reading the old one.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, text)
                os.ftruncate(fd, len(text))
            finally:
                os.close(fd)

    def hide_name(self, name: str) -> None:
        """Makes ``name`` unresolvable in every host (removes it from the hosts files)."""
        self._hidden.add(name)
        self._write_hosts_files()

    def show_name(self, name: str) -> None:
        """Makes a hidden ``name`` resolvable again."""
        self._hidden.discard(name)
        self._write_hosts_files()

    # ------------------------------------------------------------------ faults
    def link_down(self, i: int) -> None:
        """Takes host ``i``'s switch port down: its packets go nowhere, peers see silence."""
        _run(["ip", "-n", self.switch, "link", "set", self.veth(i), "down"])

    def link_up(self, i: int) -> None:
        _run(["ip", "-n", self.switch, "link", "set", self.veth(i), "up"])

    def _nft(self, i: int, script: str) -> None:
        self.run(i, ["nft", "-f", "-"], input=script)

    def partition(self, i: int) -> None:
        """Silently drops every packet in and out of host ``i`` except on loopback."""
        self._nft(i, f"""
table inet {_PARTITION_TABLE} {{
  chain input {{ type filter hook input priority -10; policy drop; iif "lo" accept; }}
  chain output {{ type filter hook output priority -10; policy drop; oif "lo" accept; }}
}}
""")

    def heal(self, i: int) -> None:
        """Undoes :meth:`partition`."""
        self._nft(i, f"delete table inet {_PARTITION_TABLE}\n")

    def loss(self, i: int, percent: int) -> None:
        """Drops ``percent`` % of the packets host ``i`` sends to other hosts (loopback spared).
        Applied to every host, each packet between two hosts is lost with that probability."""
        if not 0 <= percent <= 100:
            raise ValueError(f"percent={percent} must be within 0..100")
        self._nft(i, f"""
table inet {_LOSS_TABLE} {{
  chain output {{ type filter hook output priority 0; policy accept; oif != "lo" numgen random mod 100 < {percent} drop; }}
}}
""")

    def clear_loss(self, i: int) -> None:
        self._nft(i, f"delete table inet {_LOSS_TABLE}\n")

    def delay(self, i: int, delay_ms: float, *, lifetime_s: float = 120.0, queue_num: int = 0,
              python: str = sys.executable) -> HostProcess:
        """Delays every packet host ``i`` sends into the subnet by ``delay_ms`` (so a round trip
        between two delayed hosts gains twice that). Starts ``tests/netdelay.py`` in the host, waits
        until it has bound the queue, then adds the NFQUEUE rule. ``--queue-bypass`` lets packets
        through undelayed once the delayer is gone, and the delayer exits by itself after
        ``lifetime_s``."""
        if i in self._delayers:
            raise RuntimeError(f"host {i} already has a delayer")
        proc = self.popen(i, [python, NETDELAY, "--queue-num", str(queue_num), "--delay-ms", str(delay_ms),
                              "--lifetime-s", str(lifetime_s)])
        proc.expect_line(r"^ready\b", 30.0)
        rule = ["OUTPUT", "-d", str(self.subnet), "-j", "NFQUEUE", "--queue-num", str(queue_num), "--queue-bypass"]
        self.run(i, ["iptables", "-A", *rule])
        self._delayers[i] = (proc, rule)
        return proc

    def clear_delay(self, i: int, timeout_s: float = 10.0) -> str:
        """Removes the NFQUEUE rule, then stops the delayer (it releases what it holds); returns
        its summary line."""
        proc, rule = self._delayers.pop(i)
        self.run(i, ["iptables", "-D", *rule])
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
        if proc.wait(timeout_s) is None:
            proc.kill()
        return proc.stderr().strip().splitlines()[-1] if proc.stderr().strip() else ""
