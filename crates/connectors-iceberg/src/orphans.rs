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

/// A file found under a directory of the table (`data`, `metadata`).
pub(crate) struct Listed {
    /// Its location as the table's metadata names it: the table location,
    /// `/<dir>/`, the path below that.
    pub(crate) location: String,
    pub(crate) bytes: u64,
    pub(crate) modified: Option<SystemTime>,
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

/// Every file under `<location>/<dir>` of a table in a local warehouse.
pub(crate) fn list_local(location: &str, root: &str, dir: &str) -> StreamResult<Vec<Listed>> {
    let data = Path::new(root).join(dir);
    let mut paths = Vec::new();
    walk(&data, &mut paths).map_err(|source| StreamError::Io {
        action: "listing the files in",
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
                location: format!("{}/{dir}/{below}", location.trim_end_matches('/')),
                bytes: meta.len(),
                modified: meta.modified().ok(),
            })
        })
        .collect()
}

/// Every object under `<location>/<dir>` of a table on S3
/// (`s3://bucket/path`), listed with the table's `s3.*` properties.
pub(crate) async fn list_s3(
    location: &str,
    dir: &str,
    props: &HashMap<String, String>,
    label: &str,
) -> StreamResult<Vec<Listed>> {
    let failed = |message: String| {
        StreamError::external(
            label.to_owned(),
            "s3",
            format!("listing the files under {location}/{dir}"),
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
    let data = format!("{}/{dir}/", prefix.trim_end_matches('/'));
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

/// Who wrote a data file of the sink, from its name.
#[derive(Debug, PartialEq, Eq)]
enum Author<'a> {
    /// A writer (its id): `{sink_id}-{subtask}-{uuid}-{n}.parquet`.
    Writer(&'a str),
    /// A merge of the run of this epoch (its id):
    /// `{sink_id}-m{epoch}-{uuid}-{n}.parquet` (see `merge`).
    Merge(u64, &'a str),
}

impl<'a> Author<'a> {
    fn id(&self) -> &'a str {
        match self {
            Author::Writer(id) | Author::Merge(_, id) => id,
        }
    }
}

/// Who wrote `name` when it is a file of the sink with this prefix
/// (`{sink_id}-`). The full shape is checked so sink `a` never claims the
/// files of sink `a-b`.
fn written_by<'a>(name: &'a str, prefix: &str) -> Option<Author<'a>> {
    let rest = name
        .strip_prefix(prefix)
        .and_then(|r| r.strip_suffix(".parquet"))?;
    let parts: Vec<&str> = rest.split('-').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match parts.as_slice() {
        [by, uuid, n]
            if uuid.len() == 32 && uuid.bytes().all(|b| b.is_ascii_hexdigit()) && digits(n) =>
        {
            if digits(by) {
                Some(Author::Writer(uuid))
            } else {
                let epoch = by.strip_prefix('m').filter(|e| digits(e))?;
                Some(Author::Merge(epoch.parse().ok()?, uuid))
            }
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
/// files of this process's writers and merges that are gone (an earlier
/// attempt's) go whatever their age, and so do merged files of older runs
/// (a merged file is never in a checkpoint: only the run that made it could
/// commit it, and a newer run has fenced that one). Such a file is in no checkpoint that can still
/// commit: the earlier attempt's coordinator has ended, and what its
/// completed checkpoints hold is committed by now. Without this, a job
/// restarting on a full disk would leave each failed attempt's files
/// behind, and the disk would stay full.
pub(crate) async fn delete_orphans(
    table: &SinkTable,
    min_age: Duration,
    retired: bool,
) -> StreamResult<OrphanReport> {
    let (gone, epoch) = if retired {
        (table.retired_writers(), Some(table.claim().await?.epoch))
    } else {
        (HashSet::new(), None)
    };
    let label = table.label();
    let loaded = table.load().await?;
    let location = loaded.metadata().location().to_owned();
    let files = if let Some(root) = location
        .strip_prefix("file://")
        .or_else(|| location.starts_with('/').then_some(location.as_str()))
    {
        list_local(&location, root, "data")?
    } else if is_s3_location(&location) {
        list_s3(&location, "data", loaded.file_io().config().props(), &label).await?
    } else {
        return Ok(OrphanReport::default());
    };
    let prefix = format!("{}-", table.config.sink_id);
    let refs = referenced(&loaded, &label).await?;
    let now = SystemTime::now();
    let mut report = OrphanReport::default();
    for file in files {
        let name = file.location.rsplit('/').next().unwrap_or("");
        let Some(author) = written_by(name, &prefix) else {
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
        let older_run = matches!(author, Author::Merge(e, _) if epoch.is_some_and(|now| e < now));
        if age < min_age && !gone.contains(author.id()) && !older_run {
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
    use super::{Author, written_by};

    #[test]
    fn a_sink_claims_only_its_own_files() {
        let uuid = "0123456789abcdef0123456789abcdef";
        let a = format!("a-0-{uuid}-00001.parquet");
        let ab = format!("a-b-0-{uuid}-00001.parquet");
        assert_eq!(written_by(&a, "a-"), Some(Author::Writer(uuid)));
        assert_eq!(written_by(&ab, "a-"), None);
        assert_eq!(written_by(&ab, "a-b-"), Some(Author::Writer(uuid)));
        let merged = format!("a-m12-{uuid}-00000.parquet");
        assert_eq!(written_by(&merged, "a-"), Some(Author::Merge(12, uuid)));
        assert_eq!(written_by(&format!("a-m-{uuid}-00000.parquet"), "a-"), None);
        assert_eq!(
            written_by(&format!("a-x1-{uuid}-00000.parquet"), "a-"),
            None
        );
        assert_eq!(written_by(&format!("a-0-{uuid}-00001.avro"), "a-"), None);
        assert_eq!(written_by("a-0-x-00001.parquet", "a-"), None);
    }
}
