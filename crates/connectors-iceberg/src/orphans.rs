//! Orphan cleanup: data files this sink wrote that no snapshot references
//! (files of checkpoints that never completed, or of a crashed attempt).
//! They were never committed and never will be; this lists and deletes them.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tinyflow_api::{StreamError, StreamResult};

use crate::catalog::{SinkTable, external};

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
    /// The deleted files.
    pub files: Vec<PathBuf>,
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
                external(label, format!("reading manifest list {path}"), &e)
            })?;
        for manifest in list.entries() {
            if !manifests.insert(manifest.manifest_path.clone()) {
                continue;
            }
            let m = manifest.load_manifest(io).await.map_err(|e| {
                external(
                    label,
                    format!("reading manifest {}", manifest.manifest_path),
                    &e,
                )
            })?;
            for entry in m.entries() {
                paths.insert(entry.data_file().file_path().to_owned());
            }
        }
    }
    Ok(paths)
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

/// Whether `name` is a file the writers of the sink with this prefix
/// (`{sink_id}-`) write: `{sink_id}-{subtask}-{uuid}-{n}.parquet`. The full
/// shape is checked so sink `a` never claims the files of sink `a-b`.
fn written_by(name: &str, prefix: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(prefix)
        .and_then(|r| r.strip_suffix(".parquet"))
    else {
        return false;
    };
    let parts: Vec<&str> = rest.split('-').collect();
    matches!(parts.as_slice(), [subtask, uuid, n]
        if !subtask.is_empty() && subtask.bytes().all(|b| b.is_ascii_digit())
            && uuid.len() == 32 && uuid.bytes().all(|b| b.is_ascii_hexdigit())
            && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Lists the sink's data files under the table's local data directory and
/// deletes those no snapshot references and older than `min_age`. The age
/// bound keeps files of a running attempt (written, not yet committed)
/// safe: it must exceed the longest time a file waits for its commit.
///
/// Only local warehouses (`file://`) are cleaned; for others it lists
/// nothing.
pub(crate) async fn delete_orphans(
    table: &SinkTable,
    min_age: Duration,
) -> StreamResult<OrphanReport> {
    let label = table.label();
    let loaded = table.load().await?;
    let location = loaded.metadata().location().to_owned();
    let Some(root) = location
        .strip_prefix("file://")
        .or_else(|| location.starts_with('/').then_some(location.as_str()))
    else {
        return Ok(OrphanReport::default());
    };
    let data = Path::new(root).join("data");
    let mut files = Vec::new();
    walk(&data, &mut files).map_err(|source| StreamError::Io {
        action: "listing data files in",
        path: data.clone(),
        source,
    })?;
    let prefix = format!("{}-", table.config.sink_id);
    let refs = referenced(&loaded, &label).await?;
    let now = SystemTime::now();
    let mut report = OrphanReport::default();
    for path in files {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !written_by(name, &prefix) {
            continue;
        }
        report.listed += 1;
        let shown = path.display().to_string();
        if refs.contains(&format!("file://{shown}")) || refs.contains(&shown) {
            report.referenced += 1;
            continue;
        }
        let meta = std::fs::metadata(&path).map_err(|source| StreamError::Io {
            action: "reading the age of",
            path: path.clone(),
            source,
        })?;
        let age = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .unwrap_or_default();
        if age < min_age {
            report.too_young += 1;
            continue;
        }
        std::fs::remove_file(&path).map_err(|source| StreamError::Io {
            action: "deleting orphan data file",
            path: path.clone(),
            source,
        })?;
        tracing::debug!(sink = %label, file = %shown, "deleted orphan");
        report.deleted += 1;
        report.bytes += meta.len();
        report.files.push(path);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::written_by;

    #[test]
    fn a_sink_claims_only_its_own_files() {
        let uuid = "0123456789abcdef0123456789abcdef";
        assert!(written_by(&format!("a-0-{uuid}-00001.parquet"), "a-"));
        assert!(!written_by(&format!("a-b-0-{uuid}-00001.parquet"), "a-"));
        assert!(written_by(&format!("a-b-0-{uuid}-00001.parquet"), "a-b-"));
        assert!(!written_by(&format!("a-0-{uuid}-00001.avro"), "a-"));
        assert!(!written_by("a-0-x-00001.parquet", "a-"));
    }
}
