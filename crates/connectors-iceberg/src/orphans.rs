//! Orphan cleanup: data files this sink wrote that no snapshot references
//! (files of checkpoints that never completed, or of a crashed attempt).
//! They were never committed and never will be; this lists and deletes them.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tinyflow_api::{StreamError, StreamResult};

use crate::catalog::{external, is_s3_location};
use crate::table::SinkTable;

/// What a cleanup found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OrphanReport {
    /// Data files of the sink in the table's data directory.
    pub listed: usize,
    /// Of those, referenced by some snapshot.
    pub referenced: usize,
    /// Unreferenced but younger than the minimum age (maybe in flight).
    pub too_young: usize,
    /// Deleted.
    pub deleted: usize,
    /// Bytes deleted.
    pub bytes: u64,
    /// The deleted files' locations (`file:///...`, `s3://...`).
    pub files: Vec<String>,
}

/// Every file path any snapshot of the table references.
async fn referenced(table: &iceberg::table::Table, label: &str) -> StreamResult<HashSet<String>> {
    let metadata = table.metadata();
    let io = table.file_io();
    let mut paths = HashSet::new();
    let mut manifests = HashSet::new();
    for snapshot in metadata.snapshots() {
        let list = table
            .manifest_list_reader(snapshot)
            .load()
            .await
            .map_err(|e| {
                let path = snapshot.manifest_list();
                external(label, format!("reading manifest list {path}"), e)
            })?;
        for manifest in list.entries() {
            if !manifests.insert(manifest.manifest_path.clone()) {
                continue;
            }
            let m = manifest.load_manifest(io).await.map_err(|e| {
                external(
                    label,
                    format!("reading manifest {}", manifest.manifest_path),
                    e,
                )
            })?;
            for entry in m.entries() {
                paths.insert(entry.data_file().file_path().to_owned());
            }
        }
    }
    Ok(paths)
}

/// A file found under the table's data directory.
struct Listed {
    /// Its location as the table's manifests name it: the table location,
    /// `/data/`, the path below that.
    location: String,
    bytes: u64,
    modified: Option<SystemTime>,
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// Every file under `<location>/data` of a table in a local warehouse.
fn list_local(location: &str, root: &str) -> StreamResult<Vec<Listed>> {
    let data = Path::new(root).join("data");
    let mut paths = Vec::new();
    walk(&data, &mut paths).map_err(|source| StreamError::Io {
        action: "listing data files in",
        path: data.clone(),
        source,
    })?;
    paths
        .into_iter()
        .map(|path| {
            let meta = std::fs::metadata(&path).map_err(|source| StreamError::Io {
                action: "reading the age of",
                path: path.clone(),
                source,
            })?;
            let below = path.strip_prefix(&data).unwrap_or(&path).display();
            Ok(Listed {
                location: format!("{}/data/{below}", location.trim_end_matches('/')),
                bytes: meta.len(),
                modified: meta.modified().ok(),
            })
        })
        .collect()
}

/// Every object under `<location>/data` of a table on S3
/// (`s3://bucket/path`), listed with the table's `s3.*` properties.
async fn list_s3(
    location: &str,
    props: &HashMap<String, String>,
    label: &str,
) -> StreamResult<Vec<Listed>> {
    let failed = |message: String| {
        StreamError::external(
            label.to_owned(),
            "s3",
            format!("listing the data files under {location}"),
            message,
            true,
        )
    };
    let (scheme, rest) = location
        .split_once("://")
        .ok_or_else(|| failed("not a URL".to_owned()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let mut builder = opendal::services::S3::default().bucket(bucket).root("/");
    let prop = |key: &str| props.get(key).map(String::as_str);
    if let Some(v) = prop("s3.endpoint") {
        builder = builder.endpoint(v);
    }
    if let Some(v) = prop("s3.region").or_else(|| prop("client.region")) {
        builder = builder.region(v);
    }
    if let Some(v) = prop("s3.access-key-id") {
        builder = builder.access_key_id(v);
    }
    if let Some(v) = prop("s3.secret-access-key") {
        builder = builder.secret_access_key(v);
    }
    if let Some(v) = prop("s3.session-token") {
        builder = builder.session_token(v);
    }
    // As iceberg-storage-opendal: virtual-host style unless path style is asked for.
    if !prop("s3.path-style-access")
        .is_some_and(|v| ["true", "t", "1", "on"].contains(&v.to_lowercase().as_str()))
    {
        builder = builder.enable_virtual_host_style();
    }
    let op = opendal::Operator::new(builder)
        .map_err(|e| failed(e.to_string()))?
        .finish();
    let data = format!("{}/data/", prefix.trim_end_matches('/'));
    let entries = op
        .list_with(&data)
        .recursive(true)
        .await
        .map_err(|e| failed(e.to_string()))?;
    Ok(entries
        .into_iter()
        .filter(|e| e.metadata().is_file())
        .map(|e| Listed {
            location: format!("{scheme}://{bucket}/{}", e.path()),
            bytes: e.metadata().content_length(),
            modified: e.metadata().last_modified().map(SystemTime::from),
        })
        .collect())
}

/// The writer id (uuid) in `name` when it is a file the writers of the sink
/// with this prefix (`{sink_id}-`) write: `{sink_id}-{subtask}-{uuid}-{n}.parquet`.
/// The full shape is checked so sink `a` never claims the files of sink `a-b`.
fn written_by<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = name
        .strip_prefix(prefix)
        .and_then(|r| r.strip_suffix(".parquet"))?;
    let parts: Vec<&str> = rest.split('-').collect();
    match parts.as_slice() {
        [subtask, uuid, n]
            if !subtask.is_empty()
                && subtask.bytes().all(|b| b.is_ascii_digit())
                && uuid.len() == 32
                && uuid.bytes().all(|b| b.is_ascii_hexdigit())
                && !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit()) =>
        {
            Some(uuid)
        }
        _ => None,
    }
}

/// Lists the sink's data files under the table's data directory (local or
/// on S3) and deletes those no snapshot references and older than
/// `min_age`. The age bound keeps files of a running attempt (written, not
/// yet committed) safe: it must exceed the longest time a file waits for its
/// commit. Warehouses elsewhere are not cleaned: it lists nothing there.
///
/// With `retired`, on recovery, once the restored checkpoints are committed:
/// files of this process's writers that are gone (an earlier attempt's) go
/// whatever their age. Such a file is in no checkpoint that can still
/// commit: the earlier attempt's coordinator has ended, and what its
/// completed checkpoints hold is committed by now. Without this, a job
/// restarting on a full disk would leave each failed attempt's files
/// behind, and the disk would stay full.
pub(crate) async fn delete_orphans(
    table: &SinkTable,
    min_age: Duration,
    retired: bool,
) -> StreamResult<OrphanReport> {
    let gone = if retired {
        table.retired_writers()
    } else {
        HashSet::new()
    };
    let label = table.label();
    let loaded = table.load().await?;
    let location = loaded.metadata().location().to_owned();
    let files = if let Some(root) = location
        .strip_prefix("file://")
        .or_else(|| location.starts_with('/').then_some(location.as_str()))
    {
        list_local(&location, root)?
    } else if is_s3_location(&location) {
        list_s3(&location, loaded.file_io().config().props(), &label).await?
    } else {
        return Ok(OrphanReport::default());
    };
    let prefix = format!("{}-", table.config.sink_id);
    let refs = referenced(&loaded, &label).await?;
    let now = SystemTime::now();
    let mut report = OrphanReport::default();
    for file in files {
        let name = file.location.rsplit('/').next().unwrap_or("");
        let Some(writer) = written_by(name, &prefix) else {
            continue;
        };
        report.listed += 1;
        if refs.contains(&file.location) {
            report.referenced += 1;
            continue;
        }
        let age = file
            .modified
            .and_then(|m| now.duration_since(m).ok())
            .unwrap_or_default();
        if age < min_age && !gone.contains(writer) {
            report.too_young += 1;
            continue;
        }
        loaded.file_io().delete(&file.location).await.map_err(|e| {
            external(
                &label,
                format!("deleting orphan data file {}", file.location),
                e,
            )
        })?;
        tracing::debug!(sink = %label, file = %file.location, "deleted orphan");
        report.deleted += 1;
        report.bytes += file.bytes;
        report.files.push(file.location);
    }
    // Every unreferenced file of theirs is gone now.
    table.forget_writers(&gone);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::written_by;

    #[test]
    fn a_sink_claims_only_its_own_files() {
        let uuid = "0123456789abcdef0123456789abcdef";
        let a = format!("a-0-{uuid}-00001.parquet");
        let ab = format!("a-b-0-{uuid}-00001.parquet");
        assert_eq!(written_by(&a, "a-"), Some(uuid));
        assert_eq!(written_by(&ab, "a-"), None);
        assert_eq!(written_by(&ab, "a-b-"), Some(uuid));
        assert_eq!(written_by(&format!("a-0-{uuid}-00001.avro"), "a-"), None);
        assert_eq!(written_by("a-0-x-00001.parquet", "a-"), None);
    }
}
