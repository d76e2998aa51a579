"""Produces records with Confluent's own serializers (confluent-kafka), so a
topic in the tests holds what real producers write: the Confluent wire
format, schemas registered through the registry's REST API.

    python produce.py BOOTSTRAP TOPIC REGISTRY_URL < records.jsonl

Each input line is a JSON object, one of:
- `{"avro": SCHEMA}`: values from here on are Avro with SCHEMA (a JSON
  object or its text), registered under the subject the strategy names;
- `{"avro_key": SCHEMA}`: keys from here on are Avro with SCHEMA (subject
  `<topic>-key`); a record's `key` is then its value as fastavro takes it;
- `{"protobuf": HEX, "message": NAME}`: values from here on are Protobuf
  messages NAME (full name) of the file in the serialized
  `FileDescriptorSet` HEX, given in V as proto3 JSON (`ParseDict`);
- `{"value": V, "key": K, "partition": P, "headers": {...}}`: a record
  (`key`, `partition` and `headers` optional; a string key is sent as
  UTF-8). In V, `{"$decimal": "12.50"}` is a decimal, `{"$bytes": "0a1b"}`
  bytes given in hex; other values are as fastavro takes them (ints for
  timestamps and dates);
- `{"raw": HEX, "partition": P}`: a value of these bytes as they are (for
  payloads no serializer would write);
- `{"begin": true}` and `{"commit": true}`: a transaction around the
  records between them (needs `TINYFLOW_TRANSACTIONAL_ID`);
- `{"wait_for_file": PATH}`: waits until PATH exists (so a test can hold
  a transaction open while it changes something, e.g. stops the registry).

Options (environment): `TINYFLOW_SUBJECT_STRATEGY` = `topic` (default),
`record` or `topic-record`; `TINYFLOW_REGISTRY_AUTH` = `NAME:PASSWORD`;
`TINYFLOW_REGISTRY_CA` = the PEM file of an HTTPS registry's CA;
`TINYFLOW_TRANSACTIONAL_ID` makes the producer transactional.
Prints the number of records sent; exits non-zero if any was not delivered.
"""

import decimal
import json
import os
import sys
import time

from confluent_kafka import Producer
from confluent_kafka.schema_registry import (
    SchemaRegistryClient,
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

STRATEGIES = {
    "topic": topic_subject_name_strategy,
    "record": record_subject_name_strategy,
    "topic-record": topic_record_subject_name_strategy,
}


def python_value(v):
    if isinstance(v, dict):
        if set(v) == {"$decimal"}:
            return decimal.Decimal(v["$decimal"])
        if set(v) == {"$bytes"}:
            return bytes.fromhex(v["$bytes"])
        return {k: python_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [python_value(x) for x in v]
    return v


def protobuf_serializer(registry, strategy, item):
    """A serializer of the message `item["message"]` of the files in the
    serialized `FileDescriptorSet` `item["protobuf"]` (hex)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
    from google.protobuf import timestamp_pb2, wrappers_pb2  # noqa: F401 (in the default pool)

    files = descriptor_pb2.FileDescriptorSet.FromString(bytes.fromhex(item["protobuf"]))
    pool = descriptor_pool.Default()
    for f in files.file:
        try:
            pool.FindFileByName(f.name)
        except KeyError:
            pool.Add(f)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(item["message"]))
    inner = ProtobufSerializer(cls, registry, {"subject.name.strategy": strategy})

    def serialize(value, ctx):
        return inner(json_format.ParseDict(value, cls()), ctx)

    return serialize


def main():
    bootstrap, topic, registry_url = sys.argv[1:4]
    conf = {"url": registry_url}
    if os.environ.get("TINYFLOW_REGISTRY_AUTH"):
        conf["basic.auth.user.info"] = os.environ["TINYFLOW_REGISTRY_AUTH"]
    if os.environ.get("TINYFLOW_REGISTRY_CA"):
        conf["ssl.ca.location"] = os.environ["TINYFLOW_REGISTRY_CA"]
    registry = SchemaRegistryClient(conf)
    strategy = STRATEGIES[os.environ.get("TINYFLOW_SUBJECT_STRATEGY", "topic")]
    producer_conf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20}
    transactional = os.environ.get("TINYFLOW_TRANSACTIONAL_ID")
    if transactional:
        producer_conf["transactional.id"] = transactional
    producer = Producer(producer_conf)
    if transactional:
        producer.init_transactions(30)
    failed = []

    def delivered(err, _msg):
        if err is not None:
            failed.append(str(err))

    serializer = None
    key_serializer = None
    sent = 0
    for n, line in enumerate(sys.stdin, 1):
        line = line.strip()
        if not line:
            continue
        item = json.loads(line)
        if "begin" in item:
            producer.begin_transaction()
            continue
        if "commit" in item:
            producer.commit_transaction(60)
            continue
        if "wait_for_file" in item:
            while not os.path.exists(item["wait_for_file"]):
                time.sleep(0.05)
            continue
        if "protobuf" in item:
            serializer = protobuf_serializer(registry, strategy, item)
            continue
        if "avro_key" in item:
            schema = item["avro_key"]
            if not isinstance(schema, str):
                schema = json.dumps(schema)
            key_serializer = AvroSerializer(registry, schema)
            continue
        if "avro" in item:
            schema = item["avro"]
            if not isinstance(schema, str):
                schema = json.dumps(schema)
            serializer = AvroSerializer(
                registry, schema, conf={"subject.name.strategy": strategy}
            )
            continue
        extra = {}
        if "partition" in item:
            extra["partition"] = item["partition"]
        if "headers" in item:
            extra["headers"] = [(k, None if v is None else v.encode()) for k, v in item["headers"].items()]
        if "raw" in item:
            value = bytes.fromhex(item["raw"])
        else:
            if serializer is None:
                sys.exit(f"line {n}: a record before any schema line")
            ctx = SerializationContext(topic, MessageField.VALUE)
            value = serializer(python_value(item["value"]), ctx)
        key = item.get("key")
        if key is not None and key_serializer is not None:
            key = key_serializer(python_value(key), SerializationContext(topic, MessageField.KEY))
        elif isinstance(key, str):
            key = key.encode()
        while True:
            try:
                producer.produce(topic, value=value, key=key, on_delivery=delivered, **extra)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        sent += 1
    remaining = producer.flush(60)
    if remaining or failed:
        sys.exit(f"{remaining} records not delivered, {len(failed)} failed: {failed[:3]}")
    print(sent)


if __name__ == "__main__":
    main()
