//! Avro and Protobuf topics through the product: records written by
//! Confluent's own serializers (confluent-kafka's `AvroSerializer` and
//! `ProtobufSerializer`) against a schema registry, read by `tinyflow run`
//! into Iceberg, read back by pyiceberg.

use super::*;
use tinyflow_tests::registry::{SchemaRegistry, produce_avro, spawn_produce_avro};

/// An order with a nested record (itself holding an optional record), a
/// list of records, a map, an enum, a decimal, a UUID, a timestamp, a date,
/// bytes and an optional string.
fn order_schema() -> serde_json::Value {
    json!({
        "type": "record", "name": "Order", "namespace": "shop",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "buyer", "type": {"type": "record", "name": "Buyer", "fields": [
                {"name": "name", "type": "string"},
                {"name": "address", "type": ["null", {"type": "record", "name": "Address", "fields": [
                    {"name": "city", "type": "string"},
                    {"name": "zip", "type": ["null", "string"], "default": null}
                ]}], "default": null}
            ]}},
            {"name": "items", "type": {"type": "array", "items": {"type": "record", "name": "Item", "fields": [
                {"name": "sku", "type": "string"},
                {"name": "qty", "type": "int"}
            ]}}},
            {"name": "tags", "type": {"type": "map", "values": "long"}},
            {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["NEW", "PAID", "SHIPPED"]}},
            {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}},
            {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
            {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "day", "type": {"type": "int", "logicalType": "date"}},
            {"name": "blob", "type": "bytes"},
            {"name": "note", "type": ["null", "string"], "default": null}
        ]
    })
}

const ORDER_COLUMNS: [&str; 11] = [
    "id", "buyer", "items", "tags", "status", "price", "ref", "at", "day", "blob", "note",
];

/// Order `i` as the producer takes it, and its row as pyiceberg reads it.
fn order(i: u64) -> (serde_json::Value, Vec<serde_json::Value>) {
    let address = (!i.is_multiple_of(3)).then(|| {
        json!({"city": format!("city {}", i % 7), "zip": (i.is_multiple_of(2)).then(|| format!("{:05}", i))})
    });
    let buyer = json!({"name": format!("buyer {i}"), "address": address});
    let items: Vec<serde_json::Value> = (0..i % 4)
        .map(|k| json!({"sku": format!("sku-{i}-{k}"), "qty": k as i64 - 1}))
        .collect();
    let tags: Vec<(String, i64)> = (0..i % 3)
        .map(|k| (format!("t{k}"), (i * 10 + k) as i64))
        .collect();
    let status = ["NEW", "PAID", "SHIPPED"][(i % 3) as usize];
    let price = format!("{}.{:02}", i * 3, i % 100);
    let reference = format!("123e4567-e89b-12d3-a456-{:012x}", i);
    let at_ms = 1_700_000_000_000i64 + i as i64 * 1_001;
    let day = 19_700 + (i % 30) as i64;
    let blob = format!("{:02x}ff00", i % 256);
    let note = (i.is_multiple_of(5)).then(|| format!("note {i}"));
    let value = json!({
        "id": i, "buyer": buyer, "items": items,
        "tags": tags.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "status": status, "price": {"$decimal": price}, "ref": reference,
        "at": at_ms, "day": day, "blob": {"$bytes": blob}, "note": note,
    });
    let at = chrono_like(at_ms);
    let read = vec![
        json!(i),
        buyer,
        json!(items),
        json!(tags.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()),
        json!(status),
        json!(price),
        json!(reference),
        json!(at),
        json!(date_of(day)),
        json!(blob),
        json!(note),
    ];
    (value, read)
}

/// `ms` since the epoch as Python's `datetime.isoformat()` writes a UTC
/// timestamp.
fn chrono_like(ms: i64) -> String {
    let (days, rest) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    let (h, m, s, milli) = (
        rest / 3_600_000,
        rest / 60_000 % 60,
        rest / 1000 % 60,
        rest % 1000,
    );
    // isoformat() leaves out a zero fraction.
    let fraction = if milli == 0 {
        String::new()
    } else {
        format!(".{:06}", milli * 1000)
    };
    format!("{}T{h:02}:{m:02}:{s:02}{fraction}+00:00", date_of(days))
}

/// Days since the epoch as `YYYY-MM-DD` (proleptic Gregorian).
fn date_of(days: i64) -> String {
    let (y, m, d) = tinyflow_api::util::civil_date(days);
    format!("{y:04}-{m:02}-{d:02}")
}

fn produce_orders(bootstrap: &str, topic: &str, registry: &str, ids: std::ops::Range<u64>) {
    let mut lines = vec![json!({"avro": order_schema()})];
    lines.extend(ids.map(|i| json!({"value": order(i).0, "partition": i % PARTITIONS as u64})));
    produce_avro(bootstrap, topic, registry, &lines, &[]);
}

/// A bounded job of an Avro topic whose columns come from the registry
/// (no `[[source.fields]]`): nested records, a list of records, a map, an
/// enum, a decimal, a UUID, a timestamp, a date and bytes become Iceberg
/// columns and pyiceberg reads every row back value for value. A value not
/// in the wire format and one whose schema id the registry does not know
/// are bad records (skipped here) that take no good record with them; a
/// second run appends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_avro_job_reads_nested_records_value_for_value_with_columns_from_the_registry() {
    let registry = SchemaRegistry::start();
    let (bootstrap, topic) = new_topic("avro-orders").await;
    produce_orders(&bootstrap, &topic, &registry.url(), 0..200);
    // Bad: JSON, and the wire format with an id the registry never gave.
    produce_avro(
        &bootstrap,
        &topic,
        &registry.url(),
        &[
            json!({"raw": hex(br#"{"id": 1}"#), "partition": 0}),
            json!({"raw": "00000003e7020406", "partition": 1}),
        ],
        &[],
    );
    produce_orders(&bootstrap, &topic, &registry.url(), 200..300);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let source = format!(
        r#"bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
format = "avro"
bad_records = "skip"
registry = {{ url = "{}" }}"#,
        registry.url()
    );
    let job = bounded_job(&dir, "avro-orders", &source, "shop", "orders");
    Run::start(&job, &dir, 0).exits_0_within_120_s("a bounded Avro job still ran after 120 s");
    let log = std::fs::read_to_string(dir.join("run-0.log")).unwrap();
    assert!(
        log.contains("unknown_schema=1") && log.contains("undecodable=1"),
        "the two bad records are not counted: {log}"
    );
    produce_orders(&bootstrap, &topic, &registry.url(), 300..400);
    Run::start(&job, &dir, 1).exits_0_within_120_s("the second run still ran after 120 s");
    let mut got = tinyflow_tests::pyiceberg_rows(&dir, "shop.orders", &ORDER_COLUMNS);
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), 400, "rows");
    for (i, row) in got.iter().enumerate() {
        assert_eq!(row, &order(i as u64).1, "row {i}");
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The order schema with one more optional field: what a producer
/// evolving its records registers next (a new id).
fn order_schema_v2() -> serde_json::Value {
    let mut s = order_schema();
    s["fields"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "coupon", "type": ["null", "string"], "default": null}));
    s
}

/// A job file of an Avro topic reading columns `id`, `buyer`, `status` and
/// `note` of the orders, by name.
fn orders_job(dir: &Path, bootstrap: &str, topic: &str, registry: &str, bounded: bool) -> PathBuf {
    let job = dir.join(if bounded {
        "bounded.toml"
    } else {
        "unbounded.toml"
    });
    std::fs::write(
        &job,
        format!(
            r#"
[job]
name = "avro-outage"
parallelism = 2

[source]
bounded = {bounded}
bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
format = "avro"
registry = {{ url = "{registry}", timeout = "2s" }}
fields = [
  {{ name = "id", type = "long", required = true }},
  {{ name = "buyer", type = "struct<name: string not null>" }},
  {{ name = "status", type = "string" }},
  {{ name = "note", type = "string" }},
]

[sink]
namespace = "shop"
table = "orders"
catalog = {{ type = "sqlite", dir = "{dir}" }}

[checkpoint]
interval = "300ms"
dir = "{dir}/checkpoints"
"#,
            dir = dir.display()
        ),
    )
    .unwrap();
    job
}

/// The registry goes down while a job runs, just before records of a new
/// writer schema arrive (a transaction committed only once the registry is
/// stopped): the job says the registry does not answer and waits, reading
/// nothing of those partitions; killed with SIGKILL while it waits and
/// started again, it waits again; once the registry is back it says so and
/// goes on. Every record lands once, the new schema's too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_outage_holds_new_schemas_records_back_until_it_is_back_each_record_once() {
    let mut registry = SchemaRegistry::start();
    let (bootstrap, topic) = new_topic("avro-outage").await;
    produce_orders(&bootstrap, &topic, &registry.url(), 0..500);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = orders_job(&dir, &bootstrap, &topic, &registry.url(), false);
    let mut run = Run::start(&job, &dir, 0);
    assert!(
        run.wait_for("fetched a writer schema", Duration::from_secs(60)),
        "the job did not fetch the first schema"
    );

    // Records of a second schema, registered while the registry is up and
    // made visible only after it is stopped.
    let release = dir.join("release");
    let mut lines = vec![json!({"avro": order_schema_v2()}), json!({"begin": true})];
    lines.extend((500..1000u64).map(|i| {
        let mut v = order(i).0;
        v["coupon"] = json!(format!("c{i}"));
        json!({"value": v, "partition": i % PARTITIONS as u64})
    }));
    lines.push(json!({"wait_for_file": release.to_str().unwrap()}));
    lines.push(json!({"commit": true}));
    let producing = spawn_produce_avro(
        &bootstrap,
        &topic,
        &registry.url(),
        &lines,
        &[("TINYFLOW_TRANSACTIONAL_ID", &format!("{topic}-tx"))],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while registry.schema_count() < 2 {
        assert!(
            Instant::now() < deadline,
            "the producer did not register its schema"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    registry.stop();
    std::fs::write(&release, b"").unwrap();
    assert_eq!(producing.finish(), 500);

    assert!(
        run.wait_for(
            "the schema registry does not answer",
            Duration::from_secs(60)
        ),
        "the job did not report the registry outage"
    );
    run.assert_alive();
    run.kill();
    // Started again while the registry is still down: it waits again.
    let mut run = Run::start(&job, &dir, 1);
    assert!(
        run.wait_for(
            "the schema registry does not answer",
            Duration::from_secs(60)
        ),
        "the restarted job did not report the registry outage"
    );
    std::thread::sleep(Duration::from_secs(3));
    run.assert_alive();
    registry.restart();
    assert!(
        run.wait_for("the schema registry answers again", Duration::from_secs(60)),
        "the job did not notice the registry is back"
    );
    run.stop();
    // To the end of the topic, from the checkpoint.
    let bounded = orders_job(&dir, &bootstrap, &topic, &registry.url(), true);
    Run::start(&bounded, &dir, 2).exits_0_within_120_s("the bounded run still ran after 120 s");

    let mut got =
        tinyflow_tests::pyiceberg_rows(&dir, "shop.orders", &["id", "buyer", "status", "note"]);
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), 1000, "rows");
    for (i, row) in got.iter().enumerate() {
        let full = order(i as u64).1;
        let buyer = json!({"name": full[1]["name"]});
        assert_eq!(
            row,
            &vec![full[0].clone(), buyer, full[4].clone(), full[10].clone()],
            "row {i}"
        );
    }
}

/// The event schema at version `v` (1 to 5): v2 adds an optional field,
/// v3 widens an int to a long, v4 adds a field inside a nested record, v5
/// has `region`, which someone else added to the table meanwhile.
fn event_schema(v: u32) -> serde_json::Value {
    let mut buyer = vec![json!({"name": "name", "type": "string"})];
    if v >= 4 {
        buyer.push(json!({"name": "tier", "type": ["null", "string"], "default": null}));
    }
    let mut fields = vec![
        json!({"name": "id", "type": "long"}),
        json!({"name": "qty", "type": if v >= 3 { "long" } else { "int" }}),
        json!({"name": "buyer", "type": {"type": "record", "name": "Buyer", "fields": buyer}}),
    ];
    if v >= 2 {
        fields.push(json!({"name": "coupon", "type": ["null", "string"], "default": null}));
    }
    if v >= 5 {
        fields.push(json!({"name": "region", "type": ["null", "string"], "default": null}));
    }
    json!({"type": "record", "name": "Event", "namespace": "shop", "fields": fields})
}

/// Event `i` written with schema version `v`, and its row as pyiceberg
/// reads the evolved table: id, qty, buyer, coupon, region.
fn event(i: u64, v: u32) -> (serde_json::Value, Vec<serde_json::Value>) {
    let qty = if v >= 3 { 3_000_000_000 + i } else { i };
    let coupon = (v >= 2).then(|| format!("c{i}"));
    let tier = (v >= 4).then(|| "gold".to_owned());
    let mut buyer = json!({"name": format!("b{i}")});
    if v >= 4 {
        buyer["tier"] = json!(tier);
    }
    let mut value = json!({"id": i, "qty": qty, "buyer": buyer});
    if v >= 2 {
        value["coupon"] = json!(coupon);
    }
    let region = (v >= 5).then(|| "eu".to_owned());
    if v >= 5 {
        value["region"] = json!(region);
    }
    let row = vec![
        json!(i),
        json!(qty),
        json!({"name": format!("b{i}"), "tier": tier}),
        json!(coupon),
        json!(region),
    ];
    (value, row)
}

const PER_VERSION: u64 = 1000;

fn produce_events(bootstrap: &str, topic: &str, registry: &str, v: u32) {
    let ids = u64::from(v - 1) * PER_VERSION..u64::from(v) * PER_VERSION;
    let mut lines = vec![json!({"avro": event_schema(v)})];
    lines.extend(ids.map(|i| json!({"value": event(i, v).0, "partition": i % PARTITIONS as u64})));
    produce_avro(bootstrap, topic, registry, &lines, &[]);
}

fn evolving_job(
    dir: &Path,
    bootstrap: &str,
    topic: &str,
    registry: &str,
    bounded: bool,
) -> PathBuf {
    let job = dir.join(if bounded {
        "bounded.toml"
    } else {
        "evolving.toml"
    });
    std::fs::write(
        &job,
        format!(
            r#"
[job]
name = "avro-evolving"
parallelism = 2

[source]
bounded = {bounded}
bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
format = "avro"
registry = {{ url = "{registry}" }}

[sink]
namespace = "shop"
table = "events"
schema_evolution = "add-columns"
catalog = {{ type = "sqlite", dir = "{dir}" }}

[checkpoint]
interval = "300ms"
dir = "{dir}/checkpoints"
"#,
            dir = dir.display()
        ),
    )
    .unwrap();
    job
}

/// The topic's schema evolves three times while the job runs: a new
/// optional field, an int widened to a long (with values past the int's
/// range after it), a new field in a nested record. Each time the table
/// takes it in a schema commit of its own and the job is killed with
/// SIGKILL right after that commit, before any data under the new schema
/// is committed, then started again. The table ends with every column,
/// old rows null in the new ones, the widened column holding every value,
/// and every record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_evolving_three_times_under_sigkills_ends_in_the_evolved_table_each_record_once() {
    let registry = SchemaRegistry::start();
    let (bootstrap, topic) = new_topic("avro-evolving").await;
    produce_events(&bootstrap, &topic, &registry.url(), 1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = evolving_job(&dir, &bootstrap, &topic, &registry.url(), false);
    let mut run = Run::start(&job, &dir, 0);
    assert!(
        run.wait_for("fetched a writer schema", Duration::from_secs(60)),
        "the job did not start reading"
    );
    for v in 2..=4 {
        produce_events(&bootstrap, &topic, &registry.url(), v);
        assert!(
            run.wait_for(
                "the table took the writer schema's new columns",
                Duration::from_secs(60)
            ),
            "the table did not take schema version {v}: {}",
            std::fs::read_to_string(&run.log).unwrap_or_default()
        );
        // Between the schema commit and the data commits under it.
        run.kill();
        run = Run::start(&job, &dir, v);
        assert!(
            run.wait_for("fetched a writer schema", Duration::from_secs(60)),
            "the job did not start again after version {v}"
        );
    }
    // Someone else adds a column; records that have it fill it.
    add_column(&dir, "shop.events", "region").await;
    produce_events(&bootstrap, &topic, &registry.url(), 5);
    assert!(
        run.wait_for("columns the table already had", Duration::from_secs(60)),
        "the job did not take the column someone else added: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
    // This time the job restarts in place, with the column.
    assert!(
        run.wait_for("fetched a writer schema", Duration::from_secs(60)),
        "the job did not restart in place: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
    run.stop();
    let bounded = evolving_job(&dir, &bootstrap, &topic, &registry.url(), true);
    Run::start(&bounded, &dir, 9).exits_0_within_120_s("the bounded run still ran after 120 s");

    let mut got = tinyflow_tests::pyiceberg_rows(
        &dir,
        "shop.events",
        &["id", "qty", "buyer", "coupon", "region"],
    );
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), 5 * PER_VERSION as usize, "rows");
    for (i, row) in got.iter().enumerate() {
        let v = (i as u64 / PER_VERSION) as u32 + 1;
        assert_eq!(row, &event(i as u64, v).1, "row {i} (schema version {v})");
    }
}

/// Adds optional string column `column` to `table` as another tool would:
/// iceberg-rust's own schema update, outside tinyflow.
async fn add_column(dir: &Path, table: &str, column: &str) {
    use iceberg::transaction::{AddColumn, ApplyTransactionAction, Transaction};
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(dir);
    let c = tinyflow_connectors_iceberg::open_catalog(&catalog, Duration::from_secs(5))
        .await
        .unwrap();
    let (ns, name) = table.split_once('.').unwrap();
    let t = c
        .load_table(&iceberg::TableIdent::from_strs([ns, name]).unwrap())
        .await
        .unwrap();
    let tx = Transaction::new(&t);
    let tx = tx
        .update_schema()
        .add_column(AddColumn::optional(
            column,
            iceberg::spec::Type::Primitive(iceberg::spec::PrimitiveType::String),
        ))
        .apply(tx)
        .unwrap();
    tx.commit(c.as_ref()).await.unwrap();
}

const ORDER_PROTO: &str = r#"
syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";

// First in the file, so that Order's message index is 1, not 0.
message Header { string v = 1; }

message Order {
  int64 id = 1;
  message Address { string city = 1; optional string zip = 2; }
  message Buyer { string name = 1; Address address = 2; }
  Buyer buyer = 2;
  message Item { string sku = 1; int32 qty = 2; }
  repeated Item items = 3;
  map<string, int64> tags = 4;
  enum Status { NEW = 0; PAID = 1; SHIPPED = 2; }
  Status status = 5;
  google.protobuf.Timestamp at = 6;
  bytes blob = 7;
  optional string note = 8;
  uint64 big = 9;
}
"#;

const PROTO_COLUMNS: [&str; 10] = [
    "id",
    "buyer",
    "items",
    "tags",
    "status",
    "at",
    "blob",
    "note",
    "big",
    "_kafka_offset",
];

/// Order `i` in proto3 JSON, and its row as pyiceberg reads it (without
/// the offset).
fn proto_order(i: u64) -> (serde_json::Value, Vec<serde_json::Value>) {
    use base64::Engine as _;
    let address = (!i.is_multiple_of(3)).then(|| {
        let zip = i.is_multiple_of(2).then(|| format!("{i:05}"));
        (format!("city {}", i % 7), zip)
    });
    let mut buyer = json!({"name": format!("buyer {i}")});
    let mut buyer_read = json!({"name": format!("buyer {i}"), "address": null});
    if let Some((city, zip)) = &address {
        let mut a = json!({"city": city});
        if let Some(z) = zip {
            a["zip"] = json!(z);
        }
        buyer["address"] = a;
        buyer_read["address"] = json!({"city": city, "zip": zip});
    }
    let items: Vec<serde_json::Value> = (0..i % 4)
        .map(|k| json!({"sku": format!("sku-{i}-{k}"), "qty": k as i64 - 1}))
        .collect();
    let tags: Vec<(String, i64)> = (0..i % 3)
        .map(|k| (format!("t{k}"), (i * 10 + k) as i64))
        .collect();
    let status = ["NEW", "PAID", "SHIPPED"][(i % 3) as usize];
    let micros = 1_700_000_000_000_000i64 + i as i64 * 1_000_001;
    let blob = vec![(i % 256) as u8, 0xff, 0x00];
    let note = i.is_multiple_of(5).then(|| format!("note {i}"));
    let big = u64::MAX / 2 - i;
    let mut value = json!({
        "id": i.to_string(), "buyer": buyer, "items": items,
        "tags": tags.iter().map(|(k, v)| (k.clone(), json!(v.to_string()))).collect::<serde_json::Map<_, _>>(),
        "status": status, "at": rfc3339_micros(micros),
        "blob": base64::engine::general_purpose::STANDARD.encode(&blob),
        "big": big.to_string(),
    });
    if let Some(n) = &note {
        value["note"] = json!(n);
    }
    let read = vec![
        json!(i),
        buyer_read,
        json!(items),
        json!(tags.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()),
        json!(status),
        json!(chrono_like_micros(micros)),
        json!(hex(&blob)),
        json!(note),
        json!(big),
    ];
    (value, read)
}

fn rfc3339_micros(micros: i64) -> String {
    let (s, us) = (micros.div_euclid(1_000_000), micros.rem_euclid(1_000_000));
    let days = s.div_euclid(86_400);
    let rest = s.rem_euclid(86_400);
    format!(
        "{}T{:02}:{:02}:{:02}.{us:06}Z",
        date_of(days),
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// As pyiceberg's `isoformat()` writes a UTC timestamp of `micros`.
fn chrono_like_micros(micros: i64) -> String {
    rfc3339_micros(micros)
        .replace(".000000Z", "Z")
        .replace('Z', "+00:00")
}

/// `proto` compiled by protox into a serialized `FileDescriptorSet`, hex.
fn descriptor_set_hex(proto: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("shop_order.proto"), proto).unwrap();
    let set = protox::compile(["shop_order.proto"], [dir.path()]).unwrap();
    hex(&prost::Message::encode_to_vec(&set))
}

/// A bounded job of a Protobuf topic written by Confluent's
/// `ProtobufSerializer` (the message second in its file, so the message
/// indexes matter), whose columns come from the registry: nested messages,
/// repeated messages, a map, an enum, a `Timestamp`, bytes, an optional
/// field and a uint64 become Iceberg columns and pyiceberg reads every row
/// back value for value. A payload that is not protobuf and one not in the
/// wire format are bad records (skipped) that take no good one with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protobuf_job_reads_nested_messages_value_for_value_with_columns_from_the_registry() {
    let registry = SchemaRegistry::start();
    let (bootstrap, topic) = new_topic("proto-orders").await;
    let schema = json!({"protobuf": descriptor_set_hex(ORDER_PROTO), "message": "shop.Order"});
    let n = 300u64;
    let mut lines = vec![schema];
    lines.extend(
        (0..n).map(|i| json!({"value": proto_order(i).0, "partition": i % PARTITIONS as u64})),
    );
    produce_avro(&bootstrap, &topic, &registry.url(), &lines, &[]);
    // Bad: the wire format around bytes that are no Order (field 1 as a
    // length-delimited field cut short), and JSON.
    produce_avro(
        &bootstrap,
        &topic,
        &registry.url(),
        &[
            json!({"raw": "0000000001020a05ff", "partition": 0}),
            json!({"raw": hex(br#"{"id": 1}"#), "partition": 1}),
        ],
        &[],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let source = format!(
        r#"bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
format = "protobuf"
bad_records = "skip"
metadata_columns = true
registry = {{ url = "{}", message = "shop.Order" }}"#,
        registry.url()
    );
    let job = bounded_job(&dir, "proto-orders", &source, "shop", "orders");
    Run::start(&job, &dir, 0).exits_0_within_120_s("a bounded Protobuf job still ran after 120 s");
    let log = std::fs::read_to_string(dir.join("run-0.log")).unwrap();
    assert!(
        log.contains("bad_records=2 (undecodable=2)"),
        "the two bad records are not counted: {log}"
    );
    let mut got = tinyflow_tests::pyiceberg_rows(&dir, "shop.orders", &PROTO_COLUMNS);
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), n as usize, "rows");
    for (i, row) in got.iter().enumerate() {
        assert_eq!(&row[..9], &proto_order(i as u64).1[..], "row {i}");
    }
}

/// Avro keys (as Debezium and Kafka Connect write them: a record of the
/// row's key fields, subject `<topic>-key`) become a struct column beside
/// the value's; a record without a key has a null one, a key that is no
/// Avro datum of its schema makes its record bad (skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_avro_key_becomes_a_struct_column() {
    let registry = SchemaRegistry::start();
    let (bootstrap, topic) = new_topic("avro-keys").await;
    let key_schema = json!({"type": "record", "name": "Key", "namespace": "shop",
        "fields": [{"name": "id", "type": "long"}, {"name": "region", "type": "string"}]});
    let value_schema = json!({"type": "record", "name": "Row", "namespace": "shop",
        "fields": [{"name": "id", "type": "long"}, {"name": "qty", "type": "int"}]});
    let n = 200u64;
    let mut lines = vec![
        json!({"avro_key": key_schema}),
        json!({"avro": value_schema}),
    ];
    lines.extend((0..n).map(|i| {
        let mut line =
            json!({"value": {"id": i, "qty": i % 7}, "partition": i % PARTITIONS as u64});
        if !i.is_multiple_of(10) {
            line["key"] = json!({"id": i, "region": format!("r{}", i % 3)});
        }
        line
    }));
    produce_avro(&bootstrap, &topic, &registry.url(), &lines, &[]);
    // A good value with a key that is plain text, not Avro: bad.
    produce_avro(
        &bootstrap,
        &topic,
        &registry.url(),
        &[
            json!({"avro": value_schema}),
            json!({"value": {"id": 999, "qty": 1}, "key": "plain-text", "partition": 0}),
        ],
        &[],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let source = format!(
        r#"bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
format = "avro"
bad_records = "skip"
registry = {{ url = "{}" }}
key = {{ column = "k", type = "avro" }}"#,
        registry.url()
    );
    let job = bounded_job(&dir, "avro-keys", &source, "shop", "rows");
    Run::start(&job, &dir, 0)
        .exits_0_within_120_s("a bounded job with Avro keys still ran after 120 s");
    let log = std::fs::read_to_string(dir.join("run-0.log")).unwrap();
    assert!(
        log.contains("bad_records=1 (undecodable=1)"),
        "the bad key is not counted: {log}"
    );
    let mut got = tinyflow_tests::pyiceberg_rows(&dir, "shop.rows", &["id", "qty", "k"]);
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), n as usize, "rows");
    for (i, row) in got.iter().enumerate() {
        let i = i as u64;
        let key = if i.is_multiple_of(10) {
            json!(null)
        } else {
            json!({"id": i, "region": format!("r{}", i % 3)})
        };
        assert_eq!(row, &vec![json!(i), json!(i % 7), key], "row {i}");
    }
}

/// Producers that name subjects by record (`subject.name.strategy` =
/// record): the job finds the columns under `record:<full name>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_come_from_the_subject_the_record_strategy_names() {
    let registry = SchemaRegistry::start();
    let (bootstrap, topic) = new_topic("avro-record-subject").await;
    let n = 100u64;
    let mut lines = vec![json!({"avro": order_schema()})];
    lines.extend((0..n).map(|i| json!({"value": order(i).0, "partition": i % PARTITIONS as u64})));
    produce_avro(
        &bootstrap,
        &topic,
        &registry.url(),
        &lines,
        &[("TINYFLOW_SUBJECT_STRATEGY", "record")],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let source = format!(
        r#"bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
format = "avro"
registry = {{ url = "{}", subject = "record:shop.Order" }}"#,
        registry.url()
    );
    let job = bounded_job(&dir, "avro-record-subject", &source, "shop", "orders");
    Run::start(&job, &dir, 0).exits_0_within_120_s("the job still ran after 120 s");
    let mut got = tinyflow_tests::pyiceberg_rows(&dir, "shop.orders", &ORDER_COLUMNS);
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), n as usize, "rows");
    for (i, row) in got.iter().enumerate() {
        assert_eq!(row, &order(i as u64).1, "row {i}");
    }
}
