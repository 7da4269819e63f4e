"""``gridcomm status``: the coordinator's view of a job, once or as a live view (``--watch``)."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from typing import IO

from gridcomm._client.calls import fetch_status_call
from gridcomm._coordinator.metrics import RefusedJoin, parse_refusals
from gridcomm._errors import GridcommError
from gridcomm._proto import coordinator_pb2 as pb

_STATES = {1: "joined", 2: "left", 3: "failed"}
#: Lines a --watch frame may take at most, whatever the terminal says.
MAX_FRAME_LINES = 60
#: ANSI: cursor home, clear the screen.
_CLEAR = "\x1b[H\x1b[2J"


def ranges(ranks: Iterable[int], limit: int = 24) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2, 5, 7-8'``, at most ``limit`` pieces ('-' when empty)."""
    pieces: list[str] = []
    values = sorted(ranks)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        pieces.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    if not pieces:
        return "-"
    if len(pieces) > limit:
        return ", ".join(pieces[:limit]) + f", ... ({len(values)} ranks)"
    return ", ".join(pieces)


def _when(unix_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s)) if unix_s else "?"


def _header(reply: pb.StatusResponse) -> str:
    generation = str(reply.generation) if reply.HasField("generation") else "none yet"
    return (f"job {reply.job_id!r}: {len(reply.members)} of {reply.world_size} ranks joined, generation "
            f"{generation}, {'SERVING' if reply.serving else 'NOT_SERVING'}, up {reply.uptime_s:.1f} s")


def _last(progress: pb.Progress) -> str:
    """``all_reduce #1042, 0.3 s ago (in it)``: a rank's last collective in a communicator."""
    if not progress.entered:
        return f"{progress.communicator}: no collective yet"
    return (f"{progress.communicator}: {progress.kind or 'collective'} #{progress.entered}, {progress.age_s:.1f} s ago"
            f"{' (in it)' if progress.inside else ''}")


def _straggler(s: pb.StragglerStatus) -> str:
    return (f"rank {s.rank} enters collectives {s.lag_s * 1000:.0f} ms after the first rank, on average "
            f"(communicator {s.communicator!r}; slows every rank, not a failure)")


def render(reply: pb.StatusResponse, refusals: Sequence[RefusedJoin] = ()) -> list[str]:
    """The plain report: one line per rank (up to 256) with its last collective, who is late,
    then barriers, failures, refused joins."""
    lines = [_header(reply)]
    if reply.missing_ranks:
        lines.append(f"missing ranks ({len(reply.missing_ranks)}): {list(reply.missing_ranks)[:64]}")
    last = {p.rank: p for p in reply.progress if p.communicator == "world"}
    for m in list(reply.members)[:256]:
        seen = f"  last {_last(last[m.rank])}" if m.rank in last else ""
        lines.append(f"  rank {m.rank:>5}  {_STATES.get(m.state, '?'):<7} {m.hostname}  process {m.process_tag or '?'}"
                     f"{seen}")
    if len(reply.members) > 256:
        lines.append(f"  ... {len(reply.members) - 256} more")
    for line in reply.late:
        lines.append(f"LATE {line}")
    lines.extend(f"STRAGGLER {_straggler(s)}" for s in reply.stragglers)
    for b in reply.barriers:
        lines.append(f"barrier {b.name!r} #{b.seq}: {len(b.arrived_ranks)} arrived, waiting {b.waiting_s:.1f} s for "
                     f"{list(b.missing_ranks)[:32]}")
    for f in reply.failures:
        lines.append(f"FAILED rank {f.rank}: {f.reason}")
    for r in refusals:
        lines.append(f"REFUSED join: {r.text()}")
    return lines


def _progress_lines(reply: pb.StatusResponse, limit: int = 8) -> list[str]:
    """Each rank's last collective in 'world' (what ``status`` shows per rank), ranks that are at
    the same one as ranges, the furthest behind first: bounded however many ranks there are."""
    groups: dict[tuple[int, str, bool], list[pb.Progress]] = {}
    for p in reply.progress:
        if p.communicator == "world":
            groups.setdefault((p.entered, p.kind, p.inside), []).append(p)
    if not groups:
        return []
    lines = ["last collective (world):"]
    for (entered, kind, inside), members in sorted(groups.items())[:limit]:
        what = f"{kind or 'collective'} #{entered}" if entered else "no collective yet"
        age = max(p.age_s for p in members)
        lines.append(f"  {what}{' (in it)' if inside else ''}: ranks {ranges(p.rank for p in members)}"
                     + (f", up to {age:.1f} s ago" if entered else ""))
    if len(groups) > limit:
        lines.append(f"  ... {len(groups) - limit} more")
    return lines


def render_live(reply: pb.StatusResponse, refusals: Sequence[RefusedJoin], max_lines: int) -> list[str]:
    """The --watch frame: ranks as ranges by state, their last collectives, pending barriers longest-waiting first with
    who is late, failures and refused joins; cut to ``max_lines``."""
    by_state: dict[str, list[int]] = {"joined": [], "left": [], "failed": []}
    for m in reply.members:
        by_state.setdefault(_STATES.get(m.state, "?"), []).append(m.rank)
    lines = [_header(reply),
             f"  missing  ({len(reply.missing_ranks)}): {ranges(reply.missing_ranks)}",
             *(f"  {state:<8} ({len(ranks)}): {ranges(ranks)}" for state, ranks in by_state.items())]
    lines.extend(_progress_lines(reply))
    if reply.late:
        lines.append(f"late in collectives: {len(reply.late)}")
        lines.extend(f"  {line[:200]}" for line in reply.late[:6])
    if reply.stragglers:
        lines.append(f"stragglers: {len(reply.stragglers)}")
        lines.extend(f"  {_straggler(s)}" for s in reply.stragglers[:6])
    barriers = sorted(reply.barriers, key=lambda b: -b.waiting_s)
    lines.append(f"pending barriers: {len(barriers)}")
    for b in barriers[:10]:
        lines.append(f"  {b.name!r} #{b.seq}: waiting {b.waiting_s:.1f} s; late ({len(b.missing_ranks)}): "
                     f"{ranges(b.missing_ranks, 12)}; arrived {len(b.arrived_ranks)}")
    if len(barriers) > 10:
        lines.append(f"  ... {len(barriers) - 10} more")
    lines.append(f"failures: {len(reply.failures)}")
    for f in reply.failures[:8]:
        lines.append(f"  rank {f.rank} at {_when(f.at_unix_s)}: {f.reason[:160]}")
    if refusals:
        lines.append(f"refused joins (latest {len(refusals)}):")
        lines.extend(f"  {r.text()[:200]}" for r in refusals[-4:])
    if len(lines) > max_lines:
        lines = lines[: max_lines - 1] + [f"... ({len(lines) - max_lines + 1} lines cut; widen the terminal)"]
    return lines


def show(host: str, port: int, timeout_s: float, out: IO[str]) -> int:
    """One report (``gridcomm status``)."""
    reply, trailing = fetch_status_call(host, port, timeout_s=timeout_s)
    out.write("\n".join(render(reply, parse_refusals(trailing))) + "\n")
    return 0


def watch(host: str, port: int, interval_s: float, count: int | None, timeout_s: float, out: IO[str]) -> int:
    """Redraws the live view every ``interval_s`` (``count`` frames, or until Ctrl-C: exit 130).
    An unreachable coordinator is shown, not fatal: the view goes on trying.

    Why Ctrl-C sets a flag rather than raising: a KeyboardInterrupt raised inside a gRPC call (in
    the main thread, between gRPC's own locks) can leave the channel's close waiting forever; the
    call in flight is bounded (at most ``max(1, interval_s)``), so the view ends right after it. A
    second Ctrl-C interrupts at once."""
    tty = out.isatty()
    target = f"{host}:{port}"
    frames = 0
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        def interrupted(_signum: int, _frame: object) -> None:
            stop.set()
            signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = signal.signal(signal.SIGINT, interrupted)
    try:
        while (count is None or frames < count) and not stop.is_set():
            began = time.monotonic()
            rows = shutil.get_terminal_size((100, MAX_FRAME_LINES + 2)).lines if tty else MAX_FRAME_LINES + 2
            max_lines = max(5, min(MAX_FRAME_LINES, rows - 2))
            try:
                reply, trailing = fetch_status_call(host, port, timeout_s=min(timeout_s, max(1.0, interval_s)))
                lines = render_live(reply, parse_refusals(trailing), max_lines)
            except GridcommError as exc:
                lines = [f"{target}: no answer: {exc}", "(still trying)"]
            if stop.is_set():
                break
            stamp = f"gridcomm status {target}  {time.strftime('%H:%M:%S')}  every {interval_s:g} s; Ctrl-C ends"
            out.write((_CLEAR if tty else "") + "\n".join([stamp, *lines]) + "\n" + ("" if tty else "\n"))
            out.flush()
            frames += 1
            if count is not None and frames >= count:
                break
            stop.wait(max(0.0, interval_s - (time.monotonic() - began)))
    except KeyboardInterrupt:
        stop.set()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        out.write("\n")
        out.flush()
        return 130
    return 0
