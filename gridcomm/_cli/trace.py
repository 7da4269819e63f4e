"""``gridcomm trace DIR``: the flight records ranks wrote to ``GRIDCOMM_TRACE_DIR``, merged.

Per communicator: the last collective each rank completed and the one it is still in, where ranks
called different collectives at the same number, and who is behind (rank, host, PID): the ranks
whose last completed collective is the lowest, and the collective they did not enter. For an NCCL
rank "completed" is "returned" (enqueued); how far its GPU got, as last sampled, is added.
"""

from __future__ import annotations

import glob
import json
import os
from typing import IO, Any

from gridcomm._client.flight import FORMAT


class TraceError(Exception):
    """A directory with no flight records, or a file that is not one."""


def load(directory: str) -> list[dict[str, Any]]:
    """Every ``rank-N.json`` in ``directory``, by rank."""
    paths = sorted(glob.glob(os.path.join(directory, "rank-*.json")))
    if not paths:
        raise TraceError(f"{directory}: no flight records (rank-N.json, written where GRIDCOMM_TRACE_DIR points)")
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                body = json.load(handle)
        except (OSError, ValueError) as exc:
            raise TraceError(f"{path}: not a flight record ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise TraceError(f"{path}: not a flight record of format {FORMAT}")
        out.append(body)
    return sorted(out, key=lambda b: b.get("rank", 0))


def _who(body: dict[str, Any]) -> str:
    return f"rank {body['rank']} (host {body.get('host', '?')}, PID {body.get('pid', '?')})"


def _completed(comm: dict[str, Any]) -> int:
    """The last collective number this rank completed in ``comm``."""
    entered = int(comm.get("entered", 0))
    return entered - 1 if comm.get("inside") else entered


def merge(bodies: list[dict[str, Any]]) -> list[str]:
    """The merged report, in lines."""
    lines = [f"{len(bodies)} flight records: ranks {', '.join(str(b['rank']) for b in bodies)}"]
    for body in bodies:
        lines.append(f"  {_who(body)}, generation {body.get('generation', '?')}: {body.get('reason', '')[:300]}")
    names: list[str] = []
    for body in bodies:
        for comm in body.get("communicators", []):
            if comm["name"] not in names:
                names.append(comm["name"])
    for name in names:
        ranks = [(b, c) for b in bodies for c in b.get("communicators", []) if c["name"] == name]
        lines.append(f"communicator {name!r} ({len(ranks)} ranks wrote it):")
        calls: dict[int, dict[str, list[int]]] = {}
        for body, comm in ranks:
            done = _completed(comm)
            last = next((r for r in reversed(comm.get("records", [])) if r["number"] == done), None)
            what = f"#{done} {last['call']}" if last else f"#{done}"
            now = ""
            if comm.get("inside"):
                since = comm.get("inside_for_s")
                now = f"; in #{comm['entered']} {comm.get('kind', '')}" + (f" for {since:.1f} s" if since else "")
            if "gpu_completed" in comm:  # NCCL: a call returns once enqueued; the GPU's count is sampled
                now += f"; #{comm['gpu_completed']} known complete on its GPU"
            lines.append(f"  {_who(body)}: completed {what}{now}")
            for record in comm.get("records", []):
                calls.setdefault(record["number"], {}).setdefault(record["call"], []).append(body["rank"])
        for number in sorted(calls):
            if len(calls[number]) > 1:
                parts = "; ".join(f"ranks {', '.join(map(str, sorted(r)))} called {call}"
                                  for call, r in sorted(calls[number].items(), key=lambda kv: -len(kv[1])))
                lines.append(f"  DIVERGE at #{number}: {parts}")
                break
        reach = {body["rank"]: int(comm.get("entered", 0)) for body, comm in ranks}
        low, high = min(reach.values()), max(reach.values())
        inside = {body["rank"]: bool(comm.get("inside")) for body, comm in ranks}
        if low < high:
            ahead = [r for r in reach if reach[r] > low]
            kinds = {c.get("kind", "") for b, c in ranks if reach[b["rank"]] == low + 1 and c.get("inside")}
            nxt = calls.get(low + 1, {})
            what = f" {next(iter(nxt))}" if len(nxt) == 1 else (f" ({kinds.pop()})" if len(kinds) == 1 else "")
            waits = [c.get("inside_for_s") for b, c in ranks if b["rank"] in ahead and c.get("inside_for_s")]
            waited = f", the longest waiting {max(waits):.1f} s" if waits else ""
            for body, _ in ranks:
                if reach[body["rank"]] == low:
                    lines.append(f"  BEHIND {_who(body)} has not entered #{low + 1}{what}; ranks "
                                 f"{', '.join(map(str, sorted(ahead)))} entered it{waited}")
        elif any(inside.values()) and not all(inside.values()):
            for body, comm in ranks:
                if inside[body["rank"]]:
                    lines.append(f"  BEHIND {_who(body)} has not completed #{high} {comm.get('kind', '')}, which "
                                 "other ranks completed")
        else:
            lines.append(f"  every rank {'is in' if any(inside.values()) else 'completed'} #{high}")
    return lines


def show(directory: str, out: IO[str]) -> int:
    try:
        lines = merge(load(directory))
    except TraceError as exc:
        out.write(f"gridcomm trace: {exc}\n")
        return 2
    out.write("\n".join(lines) + "\n")
    return 0
