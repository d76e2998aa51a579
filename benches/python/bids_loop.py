#!/usr/bin/env python3
"""Baseline (5): Kafka -> Iceberg as a user might script it in Python.

Consumes JSON Nexmark bids with confluent-kafka, gathers them into columns
and, every --commit-interval seconds, appends them to the Iceberg table
`bench.bids` (pyiceberg SqlCatalog on sqlite) and then commits the consumer
offsets synchronously: at-least-once, not exactly-once.

Stops after --expect records and prints one JSON line on stdout:
    {"events": N, "seconds": S, "events_per_s": R, "appends": K, "peak_rss_mb": M}
timed from the first record received to the append holding the N-th one.
Progress goes to stderr. Exits non-zero on Kafka errors, on an undecodable
record, or when no record arrives for 120 s before N are in.

    target/pyiceberg-venv/bin/python benches/python/bids_loop.py \
        --topic T --expect 1000000 --dir /tmp/bids-run-1
"""

import argparse
import json
import resource
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401 (pa.compute)
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from pyiceberg.catalog.sql import SqlCatalog

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("auction", pa.int64(), nullable=False),
        pa.field("bidder", pa.int64(), nullable=False),
        pa.field("price", pa.int64(), nullable=False),
        pa.field("channel", pa.string(), nullable=False),
        pa.field("url", pa.string(), nullable=False),
        pa.field("date_time", pa.int64(), nullable=False),
        pa.field("extra", pa.string(), nullable=False),
    ]
)
FIELDS = SCHEMA.names
# The table also gets what the tinyflow job computes: price_eur = price / 100.
TABLE_SCHEMA = SCHEMA.append(pa.field("price_eur", pa.float64(), nullable=False))
STALL_SECONDS = 120.0
PROGRESS_SECONDS = 2.0


def peak_rss():
    """Peak RSS in MB of this process since exec (VmHWM). ru_maxrss is not
    used where VmHWM exists: after fork it starts from the parent's RSS."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fail(message):
    print(f"bids_loop: {message}", file=sys.stderr)
    sys.exit(1)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", default="127.0.0.1:9092")
    p.add_argument("--topic", required=True)
    p.add_argument("--expect", type=int, required=True, help="records to consume, then stop")
    p.add_argument("--dir", type=Path, required=True, help="fresh directory for the catalog")
    p.add_argument("--commit-interval", type=float, default=1.0, help="seconds between appends")
    return p.parse_args()


def open_table(directory):
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "catalog.db").exists():
        fail(f"{directory} already holds a catalog.db; give a fresh --dir")
    (directory / "warehouse").mkdir(exist_ok=True)
    catalog = SqlCatalog(
        "bench",
        uri=f"sqlite:///{directory.resolve()}/catalog.db",
        warehouse=f"file://{directory.resolve()}/warehouse",
    )
    catalog.create_namespace_if_not_exists("bench")
    return catalog.create_table("bench.bids", schema=TABLE_SCHEMA)


def on_error(err):
    # Called from consume(); raising here makes consume() raise.
    if err.fatal() or err.code() == KafkaError._ALL_BROKERS_DOWN:
        raise KafkaException(err)
    print(f"bids_loop: kafka: {err}", file=sys.stderr)


def main():
    args = parse_args()
    if args.expect < 1:
        fail("--expect must be at least 1")
    table = open_table(args.dir)
    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": f"bids-loop-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "error_cb": on_error,
        }
    )
    consumer.subscribe([args.topic])

    columns = {name: [] for name in FIELDS}
    next_offsets = {}  # partition -> offset after the last record in `columns`
    received = appends = 0
    first_at = appended_at = None
    last_record_at = last_flush = last_progress = time.monotonic()

    def flush():
        nonlocal appends, appended_at
        batch = pa.Table.from_pydict(columns, schema=SCHEMA)
        price_eur = pa.compute.divide(batch.column("price").cast(pa.float64()), 100.0)
        table.append(batch.append_column(TABLE_SCHEMA.field("price_eur"), price_eur))
        appended_at = time.monotonic()
        appends += 1
        consumer.commit(
            offsets=[TopicPartition(args.topic, p, o) for p, o in next_offsets.items()],
            asynchronous=False,
        )
        for values in columns.values():
            values.clear()

    try:
        while received < args.expect:
            messages = consumer.consume(num_messages=10000, timeout=0.5)
            now = time.monotonic()
            for msg in messages:
                if msg.error():
                    raise KafkaException(msg.error())
                if first_at is None:
                    first_at = now
                try:
                    record = json.loads(msg.value())
                    for name in FIELDS:
                        columns[name].append(record[name])
                except (ValueError, KeyError, TypeError) as e:
                    fail(f"{args.topic}[{msg.partition()}]@{msg.offset()}: bad bid JSON ({e!r})")
                next_offsets[msg.partition()] = msg.offset() + 1
                received += 1
                if received == args.expect:
                    break
            if messages:
                last_record_at = now
            elif now - last_record_at > STALL_SECONDS:
                fail(
                    f"topic {args.topic} at {args.bootstrap}: {received} of {args.expect} "
                    f"records, none for {STALL_SECONDS:.0f} s"
                )
            done = received == args.expect
            if columns["id"] and (done or now - last_flush >= args.commit_interval):
                flush()
                last_flush = time.monotonic()
            if now - last_progress >= PROGRESS_SECONDS:
                print(f"bids_loop: {received} records, {appends} appends", file=sys.stderr)
                last_progress = now
    except KafkaException as e:
        fail(f"kafka error (topic {args.topic} at {args.bootstrap}): {e.args[0]}")
    finally:
        consumer.close()

    seconds = appended_at - first_at
    peak_rss_mb = peak_rss()
    result = {
        "events": received,
        "seconds": round(seconds, 3),
        "events_per_s": round(received / seconds, 1),
        "appends": appends,
        "peak_rss_mb": round(peak_rss_mb, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
