"""`edgeroute capture`: the fleet's own traffic, as a router captured it (router.capture), made into a
scenario folder that `edgeroute replay DIR` runs (scenarios.replay.capture).

    edgeroute capture --router http://router:8000 --token ADMIN --minutes 10 --out my-fleet
    edgeroute capture --kafka kafka:9092 --topic edgeroute.capture --minutes 10 --out my-fleet
    edgeroute capture --files /var/lib/edgeroute/capture other-router/ --out my-fleet

`--router` reads one router's newest records (its memory holds the last `capture.ring_bytes`);
`--kafka` reads every router's from the capture topic, from `--minutes` ago (the records of several
routers and sites merge there); `--files` reads capture segments (or folders of them) that routers
wrote, merged.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from scenarios.cli import args as arg

CAPTURE_TOPIC = "edgeroute.capture"  # the topic `edgeroute up --capture` publishes to and --kafka reads


def add_capture_parser(sub: Any) -> None:
    p = sub.add_parser(
        "capture", help="make a scenario folder of the fleet's own traffic, as routers captured it (replay it after)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--router", metavar="URL", help="a router with capture on: its newest records")
    src.add_argument("--kafka", type=arg.bootstrap, help="the capture topic's Kafka bootstrap HOST:PORT")
    src.add_argument("--files", nargs="+", metavar="PATH", help="capture segments (or folders of them) to merge")
    p.add_argument("--topic", default=CAPTURE_TOPIC, help="the capture topic (with --kafka)")
    p.add_argument("--token", help="an admin token for --router (default $EDGEROUTE_ADMIN_TOKEN)")
    p.add_argument("--minutes", type=arg.positive, help="the last N minutes (default: all there is)")
    p.add_argument("--out", required=True, help="the scenario folder to write")
    p.add_argument("--name", help="the scenario's name (default: the folder's)")
    p.set_defaults(func=run_capture)


def _from_router(url: str, token: str | None, since_ms: float) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"{url.rstrip('/')}/admin/capture?since_ms={since_ms:.0f}", headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - an operator's own router
        data: bytes = resp.read()
        return data


def _from_kafka(bootstrap: str, topic: str, since_ms: float, into: Any) -> None:
    from kafka import KafkaConsumer, TopicPartition

    from scenarios.replay.capture import read_lines

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not parts:
            raise RuntimeError(f"topic {topic}: not found on {bootstrap}")
        consumer.assign(parts)
        offsets = consumer.offsets_for_times({tp: int(since_ms) for tp in parts})
        ends = consumer.end_offsets(parts)
        for tp in parts:
            found = offsets.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
        for msg in consumer:
            read_lines(msg.value.splitlines(keepends=True), f"{topic}:{msg.partition}:{msg.offset}", into)
            if all(consumer.position(tp) >= ends[tp] for tp in parts):
                break
    finally:
        consumer.close()


def run_capture(args: argparse.Namespace) -> int:
    from scenarios.replay.capture import Captured, CaptureError, read_files, read_lines, scenario_of, write_folder

    since = 0.0 if args.minutes is None else time.time() * 1000.0 - args.minutes * 60_000.0
    captured = Captured()
    try:
        if args.router:
            token = args.token or os.environ.get("EDGEROUTE_ADMIN_TOKEN")
            try:
                raw = _from_router(args.router, token, since)
            except urllib.error.HTTPError as exc:
                return arg.usage(f"capture --router: {args.router} answered {exc.code}: {exc.read()[:200]!r}")
            except (urllib.error.URLError, OSError) as exc:
                return arg.usage(f"capture --router: cannot reach {args.router}: {exc}")
            read_lines(raw.splitlines(keepends=True), args.router, captured)
        elif args.kafka:
            _from_kafka(args.kafka, args.topic, since, captured)
        else:
            read_files([Path(f) for f in args.files], captured)
        out = Path(args.out)
        doc, traces, recorded = scenario_of(captured, args.name or out.resolve().name, args.minutes)
    except (CaptureError, RuntimeError) as exc:
        return arg.usage(f"capture: {exc}")
    path = write_folder(out, doc, traces, recorded)
    sites = ", ".join(doc["topology"]["partitions"])
    print(
        f"capture: {recorded['sent']} requests over {doc['workload']['duration_s']:.0f} s from "
        f"{len(captured.routers)} router(s), {len(doc['topology']['nodes'])} nodes at {sites}; "
        f"recorded SLO {recorded['slo_attainment'] * 100:.1f}% under {recorded.get('policy') or 'its policy'}",
        flush=True,
    )
    print(f"scenario: {path} (edgeroute replay {out} --mode sim --policy CANDIDATE ...)", flush=True)
    return 0


__all__ = ["add_capture_parser", "run_capture"]
