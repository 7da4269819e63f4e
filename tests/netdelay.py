"""A userspace packet delayer for one network namespace (this kernel has no netem).

An iptables rule sends packets to an NFQUEUE; this holds each one for ``--delay-ms`` and then accepts
it, in arrival order. Run it inside the namespace, before adding the rule::

    ip netns exec NS python tests/netdelay.py --queue-num 0 --delay-ms 50 --lifetime-s 60 &
    # wait for "ready" on its stdout, then:
    ip netns exec NS iptables -A OUTPUT -d 10.200.0.0/24 -j NFQUEUE --queue-num 0 --queue-bypass

It stops by itself after ``--lifetime-s`` (or on SIGTERM/SIGINT), accepting every packet it still
holds, and prints a one-line summary to stderr. With ``--queue-bypass`` on the rule, packets flow
undelayed once it is gone, so a forgotten delayer can slow a test but never cut its network.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue-num", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--lifetime-s", type=float, required=True, help="exit after this long, whatever happens")
    parser.add_argument("--max-len", type=int, default=8192, help="kernel queue length (packets)")
    args = parser.parse_args(argv)
    if not (args.delay_ms >= 0 and 0 < args.lifetime_s <= 3600):
        parser.error("--delay-ms must be >= 0 and --lifetime-s within (0, 3600]")

    from netfilterqueue import COPY_META, NetfilterQueue

    delay_s = args.delay_ms / 1000.0
    held: list[tuple[float, int, Any]] = []  # (due, arrival number, packet): a heap
    arrivals = itertools.count()
    stats = {"packets": 0, "max_held": 0, "max_late_ms": 0.0}

    def on_packet(packet: Any) -> None:
        heapq.heappush(held, (time.monotonic() + delay_s, next(arrivals), packet))
        stats["packets"] += 1
        stats["max_held"] = max(stats["max_held"], len(held))

    # Why a wake-up pipe: a signal must end the select() at once, not at its next timeout.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stopping = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    queue = NetfilterQueue()
    # COPY_META: the payload is never looked at, so the kernel need not copy it to us.
    queue.bind(args.queue_num, on_packet, max_len=args.max_len, mode=COPY_META)
    end = time.monotonic() + args.lifetime_s
    reason = "lifetime over"
    print("ready", flush=True)
    try:
        fd = queue.get_fd()
        while True:
            now = time.monotonic()
            while held and held[0][0] <= now:
                due, _, packet = heapq.heappop(held)
                stats["max_late_ms"] = max(stats["max_late_ms"], (now - due) * 1000.0)
                packet.accept()
            if stopping:
                reason = "signal"
                break
            if now >= end:
                break
            next_due = held[0][0] if held else end
            ready, _, _ = select.select([fd, wake_r], [], [], max(0.0, min(next_due, end) - now))
            if fd in ready:
                queue.run(block=False)
            if wake_r in ready:
                os.read(wake_r, 512)
    finally:
        released = len(held)
        while held:
            heapq.heappop(held)[2].accept()
        queue.unbind()
    print(f"netdelay: stopped ({reason}); delayed {stats['packets']} packets by {args.delay_ms:g} ms, "
          f"at most {stats['max_held']} held, at most {stats['max_late_ms']:.1f} ms late, released {released} early",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
