//! Protobuf values in the Confluent wire format: a zero byte, the writer
//! schema's registry id (4 bytes, big-endian), the message indexes (which
//! message of the schema's file: a zigzag varint count, then that many
//! zigzag varint indexes; a single zero byte for the first message), the
//! protobuf binary.
//!
//! The schema is compiled with protox (a pure-Rust protobuf compiler): the
//! registry holds `.proto` text (Confluent's registry returns that) or a
//! base64 `FileDescriptorProto` (what confluent-kafka's Python serializer
//! registers); Google's well-known types resolve without the registry.
//! Each message is decoded with prost-reflect and written as one JSON
//! object (proto field names; 64-bit integers as numbers; enums by name;
//! bytes in hex; `google.protobuf.Timestamp` as RFC 3339; wrappers as their
//! value), which the JSON path then decodes into the columns with its
//! checks (exact fit, bad records one by one).

use std::fmt::Write as _;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use prost::Message as _;
use prost_reflect::{
    DynamicMessage, FieldDescriptor, FileDescriptor, Kind, MapKey, MessageDescriptor,
    ReflectMessage, Value,
};
use protox::file::{File, FileResolver, GoogleFileResolver};

/// Where the schema's text is: the one file a registry schema is.
const SCHEMA_FILE: &str = "registry-schema.proto";

/// Resolves the registry's schema (and Google's well-known types).
struct Registered {
    name: String,
    source: Source,
    google: GoogleFileResolver,
}

enum Source {
    Text(String),
    Descriptor(Box<prost_types::FileDescriptorProto>),
}

impl FileResolver for Registered {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        if name == self.name {
            return match &self.source {
                Source::Text(t) => File::from_source(name, t),
                Source::Descriptor(d) => Ok(File::from_file_descriptor_proto((**d).clone())),
            };
        }
        self.google.open_file(name)
    }
}

/// The file of a registry schema: `.proto` text, or a base64
/// `FileDescriptorProto`.
pub(crate) fn compile(schema: &str) -> Result<FileDescriptor, String> {
    let descriptor = decode_base64(schema.trim())
        .and_then(|bytes| prost_types::FileDescriptorProto::decode(bytes.as_slice()).ok())
        .filter(|d| d.name.is_some() || !d.message_type.is_empty());
    let (name, source) = match descriptor {
        Some(d) => (
            d.name.clone().unwrap_or_else(|| SCHEMA_FILE.to_owned()),
            Source::Descriptor(Box::new(d)),
        ),
        None => (SCHEMA_FILE.to_owned(), Source::Text(schema.to_owned())),
    };
    let mut compiler = protox::Compiler::with_file_resolver(Registered {
        name: name.clone(),
        source,
        google: GoogleFileResolver::new(),
    });
    compiler
        .open_file(&name)
        .map_err(|e| format!("not a protobuf schema protox compiles: {e}"))?;
    compiler
        .descriptor_pool()
        .get_file_by_name(&name)
        .ok_or_else(|| "the compiled schema has no file".to_owned())
}

fn decode_base64(s: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    if s.is_empty() || s.contains(char::is_whitespace) {
        return None;
    }
    base64::engine::general_purpose::STANDARD.decode(s).ok()
}

/// A zigzag varint at the start of `b`: its value and length.
fn zigzag(b: &[u8]) -> Option<(i64, usize)> {
    let mut v: u64 = 0;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((((v >> 1) as i64) ^ -((v & 1) as i64), i + 1));
        }
    }
    None
}

/// The message indexes after the 5-byte prefix, and where the body starts.
pub(crate) fn message_indexes(payload: &[u8]) -> Result<(Vec<i64>, usize), String> {
    let mut at = 5;
    let (count, n) =
        zigzag(&payload[at.min(payload.len())..]).ok_or("the message indexes are cut short")?;
    at += n;
    if count == 0 {
        return Ok((vec![0], at));
    }
    if !(1..=100).contains(&count) {
        return Err(format!("{count} message indexes"));
    }
    let mut indexes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (i, n) =
            zigzag(&payload[at.min(payload.len())..]).ok_or("the message indexes are cut short")?;
        indexes.push(i);
        at += n;
    }
    Ok((indexes, at))
}

/// The message the indexes name in `file`.
pub(crate) fn message_at(
    file: &FileDescriptor,
    indexes: &[i64],
) -> Result<MessageDescriptor, String> {
    let bad = || format!("message indexes {indexes:?} name no message of the schema");
    let first = usize::try_from(*indexes.first().ok_or_else(bad)?).map_err(|_| bad())?;
    let mut m = file.messages().nth(first).ok_or_else(bad)?;
    for i in &indexes[1..] {
        let i = usize::try_from(*i).map_err(|_| bad())?;
        let child = m.child_messages().nth(i);
        m = child.ok_or_else(bad)?;
    }
    Ok(m)
}

/// The message named `name` (full name, or the first top-level message).
pub(crate) fn message_named(
    file: &FileDescriptor,
    name: Option<&str>,
) -> Result<MessageDescriptor, String> {
    match name {
        None => file
            .messages()
            .next()
            .ok_or_else(|| "the schema has no message".to_owned()),
        Some(n) => file
            .parent_pool()
            .get_message_by_name(n)
            .or_else(|| {
                file.parent_pool()
                    .get_message_by_name(&format!("{}.{n}", file.package_name()))
            })
            .ok_or_else(|| format!("the schema has no message {n:?}")),
    }
}

/// Decodes `body` as `desc` and appends it to `out` as a JSON object.
pub(crate) fn to_json(
    desc: &MessageDescriptor,
    body: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let msg = DynamicMessage::decode(desc.clone(), body)
        .map_err(|e| format!("not a {} message: {e}", desc.full_name()))?;
    let mut s = String::with_capacity(body.len() * 2);
    write_message(&msg, &mut s, 0)?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

const MAX_DEPTH: usize = 64;

fn write_message(msg: &DynamicMessage, out: &mut String, depth: usize) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("nested deeper than {MAX_DEPTH}"));
    }
    out.push('{');
    let mut first = true;
    for f in msg.descriptor().fields() {
        // A field that can be absent and is: left out (null).
        if f.supports_presence() && !msg.has_field(&f) {
            continue;
        }
        if !first {
            out.push(',');
        }
        first = false;
        write_str(f.name(), out);
        out.push(':');
        write_value(&f, &msg.get_field(&f), out, depth)?;
    }
    out.push('}');
    Ok(())
}

fn write_value(
    f: &FieldDescriptor,
    v: &Value,
    out: &mut String,
    depth: usize,
) -> Result<(), String> {
    match v {
        Value::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_single(&f.kind(), item, out, depth)?;
            }
            out.push(']');
            Ok(())
        }
        Value::Map(map) => {
            let Kind::Message(entry) = f.kind() else {
                return Err(format!("map field `{}` without an entry type", f.name()));
            };
            let value_kind = entry.map_entry_value_field().kind();
            let mut entries: Vec<(String, &Value)> =
                map.iter().map(|(k, v)| (map_key(k), v)).collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_str(&k, out);
                out.push(':');
                write_single(&value_kind, v, out, depth)?;
            }
            out.push('}');
            Ok(())
        }
        v => write_single(&f.kind(), v, out, depth),
    }
}

fn map_key(k: &MapKey) -> String {
    match k {
        MapKey::Bool(b) => b.to_string(),
        MapKey::I32(i) => i.to_string(),
        MapKey::I64(i) => i.to_string(),
        MapKey::U32(i) => i.to_string(),
        MapKey::U64(i) => i.to_string(),
        MapKey::String(s) => s.clone(),
    }
}

fn write_single(kind: &Kind, v: &Value, out: &mut String, depth: usize) -> Result<(), String> {
    match v {
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::I32(i) => {
            let _ = write!(out, "{i}");
        }
        Value::I64(i) => {
            let _ = write!(out, "{i}");
        }
        Value::U32(i) => {
            let _ = write!(out, "{i}");
        }
        Value::U64(i) => {
            let _ = write!(out, "{i}");
        }
        Value::F32(x) if x.is_finite() => {
            let _ = write!(out, "{x}");
        }
        Value::F64(x) if x.is_finite() => {
            let _ = write!(out, "{x}");
        }
        Value::F32(_) | Value::F64(_) => return Err(
            "a float that is not finite (NaN or infinite), which JSON and the column cannot hold"
                .to_owned(),
        ),
        Value::String(s) => write_str(s, out),
        Value::Bytes(b) => {
            out.push('"');
            for byte in b.iter() {
                let _ = write!(out, "{byte:02x}");
            }
            out.push('"');
        }
        Value::EnumNumber(n) => match kind {
            Kind::Enum(e) => match e.get_value(*n) {
                Some(v) => write_str(v.name(), out),
                None => {
                    let _ = write!(out, "\"{n}\"");
                }
            },
            _ => {
                let _ = write!(out, "{n}");
            }
        },
        Value::Message(m) => match m.descriptor().full_name() {
            "google.protobuf.Timestamp" => {
                let seconds = m
                    .get_field_by_name("seconds")
                    .and_then(|v| v.as_i64())
                    .unwrap_or(0);
                let nanos = m
                    .get_field_by_name("nanos")
                    .and_then(|v| v.as_i32())
                    .unwrap_or(0);
                write_str(&rfc3339(seconds, nanos)?, out);
            }
            "google.protobuf.DoubleValue"
            | "google.protobuf.FloatValue"
            | "google.protobuf.Int64Value"
            | "google.protobuf.UInt64Value"
            | "google.protobuf.Int32Value"
            | "google.protobuf.UInt32Value"
            | "google.protobuf.BoolValue"
            | "google.protobuf.StringValue"
            | "google.protobuf.BytesValue" => {
                let f = m
                    .descriptor()
                    .get_field_by_name("value")
                    .ok_or("a wrapper without a value")?;
                write_single(&f.kind(), &m.get_field(&f), out, depth + 1)?;
            }
            _ => write_message(m, out, depth + 1)?,
        },
        Value::List(_) | Value::Map(_) => return Err("a list or map inside a list".to_owned()),
    }
    Ok(())
}

fn write_str(s: &str, out: &mut String) {
    // serde_json escapes exactly as JSON requires.
    out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned()));
}

/// `seconds` and `nanos` since the epoch as RFC 3339 in UTC, with as many
/// fraction digits as needed (6 for microseconds, 9 for nanoseconds).
fn rfc3339(seconds: i64, nanos: i32) -> Result<String, String> {
    if !(0..1_000_000_000).contains(&nanos) {
        return Err(format!("a Timestamp with {nanos} nanoseconds"));
    }
    let days = seconds.div_euclid(86_400);
    let rest = seconds.rem_euclid(86_400);
    let (y, m, d) = tinyflow_api::util::civil_date(days);
    let fraction = if nanos == 0 {
        String::new()
    } else if nanos % 1000 == 0 {
        format!(".{:06}", nanos / 1000)
    } else {
        format!(".{nanos:09}")
    };
    Ok(format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}{fraction}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    ))
}

/// The columns of messages of `desc`: proto field names; scalars without
/// presence required (proto3 always has a value), fields with presence,
/// messages and wrappers optional; repeated fields lists and maps maps
/// (never null: empty); enums as strings, 64-bit and unsigned integers as
/// long, bytes as binary, `Timestamp` as timestamptz.
pub(crate) fn arrow_schema(desc: &MessageDescriptor) -> Result<SchemaRef, String> {
    Ok(Arc::new(Schema::new(fields(desc, 0)?)))
}

fn fields(desc: &MessageDescriptor, depth: usize) -> Result<Fields, String> {
    if depth > 32 {
        return Err(format!(
            "message {} is recursive, which a table cannot hold",
            desc.full_name()
        ));
    }
    desc.fields()
        .map(|f| {
            let ty = if f.is_map() {
                let Kind::Message(entry) = f.kind() else {
                    return Err(format!("map field `{}` without an entry type", f.name()));
                };
                let value = entry.map_entry_value_field();
                let (vty, vnull) = single_type(&value.kind(), depth)?;
                DataType::Map(
                    Arc::new(Field::new(
                        "key_value",
                        DataType::Struct(
                            vec![
                                Field::new("key", DataType::Utf8, false),
                                Field::new("value", vty, vnull),
                            ]
                            .into(),
                        ),
                        false,
                    )),
                    false,
                )
            } else if f.is_list() {
                let (ety, _) = single_type(&f.kind(), depth)?;
                DataType::List(Arc::new(Field::new("element", ety, false)))
            } else {
                let (ty, nullable) = single_type(&f.kind(), depth)?;
                return Ok(Field::new(f.name(), ty, nullable || f.supports_presence()));
            };
            Ok(Field::new(f.name(), ty, false))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Fields::from)
}

/// A single value's column type, and whether it may be null.
fn single_type(kind: &Kind, depth: usize) -> Result<(DataType, bool), String> {
    Ok(match kind {
        Kind::Bool => (DataType::Boolean, false),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => (DataType::Int32, false),
        Kind::Int64
        | Kind::Sint64
        | Kind::Sfixed64
        | Kind::Uint32
        | Kind::Fixed32
        | Kind::Uint64
        | Kind::Fixed64 => (DataType::Int64, false),
        Kind::Float => (DataType::Float32, false),
        Kind::Double => (DataType::Float64, false),
        Kind::String | Kind::Enum(_) => (DataType::Utf8, false),
        Kind::Bytes => (DataType::Binary, false),
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Timestamp" => (
                DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into())),
                true,
            ),
            "google.protobuf.DoubleValue" => (DataType::Float64, true),
            "google.protobuf.FloatValue" => (DataType::Float32, true),
            "google.protobuf.Int64Value"
            | "google.protobuf.UInt64Value"
            | "google.protobuf.UInt32Value" => (DataType::Int64, true),
            "google.protobuf.Int32Value" => (DataType::Int32, true),
            "google.protobuf.BoolValue" => (DataType::Boolean, true),
            "google.protobuf.StringValue" => (DataType::Utf8, true),
            "google.protobuf.BytesValue" => (DataType::Binary, true),
            _ => (DataType::Struct(fields(m, depth + 1)?), true),
        },
    })
}

/// The columns of the message `message` (full name; default the first) of
/// a registry schema (`.proto` text or a base64 `FileDescriptorProto`).
pub fn arrow_schema_of(schema: &str, message: Option<&str>) -> Result<SchemaRef, String> {
    let file = compile(schema)?;
    arrow_schema(&message_named(&file, message)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = r#"
syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";
message Order {
  int64 id = 1;
  message Item { string sku = 1; int32 qty = 2; }
  repeated Item items = 2;
  map<string, int64> tags = 3;
  enum Status { NEW = 0; PAID = 1; }
  Status status = 4;
  google.protobuf.Timestamp at = 5;
  optional string note = 6;
  bytes blob = 7;
}
"#;

    #[test]
    fn proto_text_compiles_and_maps_to_columns() {
        let schema = arrow_schema_of(ORDER, None).unwrap();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(
            names,
            ["id", "items", "tags", "status", "at", "note", "blob"]
        );
        assert!(
            !schema.field(0).is_nullable(),
            "a proto3 scalar always has a value"
        );
        assert!(
            schema.field(5).is_nullable(),
            "an optional field may be absent"
        );
        assert_eq!(schema.field(3).data_type(), &DataType::Utf8);
        assert!(matches!(
            schema.field(4).data_type(),
            DataType::Timestamp(TimeUnit::Microsecond, Some(_))
        ));
    }

    #[test]
    fn a_message_becomes_json_with_names_numbers_and_rfc3339() {
        let file = compile(ORDER).unwrap();
        let desc = message_named(&file, Some("shop.Order")).unwrap();
        let mut msg = DynamicMessage::new(desc.clone());
        msg.set_field_by_name("id", Value::I64(1 << 40));
        msg.set_field_by_name("status", Value::EnumNumber(1));
        let mut at = DynamicMessage::new(
            file.parent_pool()
                .get_message_by_name("google.protobuf.Timestamp")
                .unwrap(),
        );
        at.set_field_by_name("seconds", Value::I64(1_700_000_000));
        at.set_field_by_name("nanos", Value::I32(123_456_000));
        msg.set_field_by_name("at", Value::Message(at));
        msg.set_field_by_name("blob", Value::Bytes(vec![0xff, 0x00].into()));
        let mut out = Vec::new();
        to_json(&desc, &msg.encode_to_vec(), &mut out).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"id": 1u64 << 40, "items": [], "tags": {}, "status": "PAID",
                "at": "2023-11-14T22:13:20.123456Z", "blob": "ff00"})
        );
    }

    #[test]
    fn message_indexes_follow_confluents_encoding() {
        // Count 0: the first message.
        assert_eq!(
            message_indexes(&[0, 0, 0, 0, 1, 0, 9]).unwrap(),
            (vec![0], 6)
        );
        // Count 2 (zigzag 4), indexes 1 and 0 (zigzag 2, 0).
        assert_eq!(
            message_indexes(&[0, 0, 0, 0, 1, 4, 2, 0, 9]).unwrap(),
            (vec![1, 0], 8)
        );
        assert!(message_indexes(&[0, 0, 0, 0, 1, 4, 2]).is_err());
    }
}
