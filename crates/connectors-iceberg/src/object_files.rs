//! [`ObjectFiles`]: whole objects under one location, on S3 (and
//! compatible stores) or in a local directory, for what must outlive the
//! machine a job runs on besides its tables (the checkpoint store on object
//! storage; `tinyflow-checkpoint` names no storage client, so the CLI joins
//! the two).
//!
//! S3 goes through the storage the catalog gives tables whose warehouse is
//! not local: iceberg's `FileIO` over `iceberg-storage-opendal`'s resolving
//! storage, built from the same `s3.*` properties (`s3.endpoint`,
//! `s3.region`, `s3.access-key-id`, `s3.secret-access-key`,
//! `s3.session-token`, `s3.path-style-access`, ...; without keys, the usual
//! AWS environment variables and profiles), with its per-request timeouts
//! and retries of temporary failures. An S3 PUT replaces an object
//! atomically, so a reader sees the old object or the new one.
//!
//! A local directory (`file:///path` or a plain path) gets the same
//! promise the hard way: each put writes a hidden temporary file beside the
//! target, syncs it, renames it into place and syncs the directory, on
//! tokio's blocking pool (which finishes the write even when its future is
//! dropped).
//!
//! Errors name the location and the action (`reading
//! s3://bucket/prefix/_index`). S3 errors are retryable unless the store
//! refused the request for good (refused credentials, a missing bucket, a
//! bad configuration); local file errors are `StreamError::Io`. The values
//! of secret properties are registered with `tinyflow_api::secrets` when
//! the location is opened, and `Debug` masks them.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use iceberg::io::{FileIO, FileIOBuilder};
use iceberg_storage_opendal::OpenDalResolvingStorageFactory;
use tinyflow_api::{StreamError, StreamResult, secrets};

use crate::catalog::is_s3_location;
use crate::local_storage::local_path;

/// Who the errors of [`ObjectFiles`] name.
const OPERATOR: &str = "object storage";

/// Whole objects under one location. See the module docs.
pub struct ObjectFiles {
    /// As given, without trailing slashes.
    location: String,
    backend: Backend,
    /// The properties with secret values masked, for `Debug`.
    shown: BTreeMap<String, String>,
}

enum Backend {
    S3(FileIO),
    Local(PathBuf),
}

impl std::fmt::Debug for ObjectFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectFiles")
            .field("location", &self.location)
            .field("properties", &self.shown)
            .finish()
    }
}

impl ObjectFiles {
    /// The objects under `location`: `s3://bucket/prefix` (also `s3a://`,
    /// `s3n://`), reached with the `s3.*` keys of `properties`, or
    /// `file:///path` or a plain path (created at the first put). Makes no
    /// request; the first `get` or `put` shows whether the store answers.
    pub fn open(location: &str, properties: &HashMap<String, String>) -> StreamResult<ObjectFiles> {
        secrets::register_settings(
            properties
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .chain([("location", location)]),
        );
        let trimmed = location.trim_end_matches('/');
        let s3 = is_s3_location(location);
        let refused = |why: &str| {
            StreamError::external(
                OPERATOR,
                if s3 { "s3" } else { "file" },
                format!("opening {location}"),
                why.to_owned(),
                false,
            )
        };
        let backend = if s3 {
            let (_, rest) = trimmed.split_once("://").unwrap_or_default();
            if rest.split('/').next().is_none_or(str::is_empty) {
                return Err(refused("no bucket in the location (s3://bucket/prefix)"));
            }
            let io = FileIOBuilder::new(Arc::new(OpenDalResolvingStorageFactory::new()))
                .with_props(properties.iter())
                .build();
            Backend::S3(io)
        } else if location.starts_with("file:") || !location.contains("://") {
            if trimmed.is_empty() || trimmed == "file:" {
                return Err(refused("not a directory of its own"));
            }
            Backend::Local(local_path(trimmed))
        } else {
            return Err(refused(
                "unsupported scheme: use s3://bucket/prefix, file:///path or a local path",
            ));
        };
        let shown = properties
            .iter()
            .map(|(k, v)| (k.clone(), secrets::shown(k, v).to_owned()))
            .collect();
        Ok(ObjectFiles {
            location: trimmed.to_owned(),
            backend,
            shown,
        })
    }

    /// The location, without trailing slashes.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The object `name` (relative to the location, `/`-separated), or
    /// `None` when there is none.
    pub async fn get(&self, name: &str) -> StreamResult<Option<Vec<u8>>> {
        let at = self.at(name)?;
        match &self.backend {
            Backend::S3(io) => {
                let read = match io.new_input(&at) {
                    Ok(input) => input.read().await,
                    Err(e) => Err(e),
                };
                match read {
                    Ok(bytes) => Ok(Some(bytes.to_vec())),
                    Err(e) if opendal_kind(&e) == Some(opendal::ErrorKind::NotFound) => Ok(None),
                    Err(e) => Err(s3_error("reading", &at, e)),
                }
            }
            Backend::Local(dir) => {
                let path = dir.join(name);
                blocking(move || match fs::read(&path) {
                    Ok(bytes) => Ok(Some(bytes)),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                    Err(source) => Err(StreamError::Io {
                        action: "reading",
                        path,
                        source,
                    }),
                })
                .await
            }
        }
    }

    /// Writes the object `name` whole, replacing an existing one
    /// atomically; returns once it is durable.
    pub async fn put(&self, name: &str, bytes: Vec<u8>) -> StreamResult<()> {
        let at = self.at(name)?;
        match &self.backend {
            Backend::S3(io) => {
                let written = match io.new_output(&at) {
                    Ok(output) => output.write(Bytes::from(bytes)).await,
                    Err(e) => Err(e),
                };
                written.map_err(|e| s3_error("writing", &at, e))
            }
            Backend::Local(dir) => {
                let path = dir.join(name);
                blocking(move || replace_synced(&path, &bytes)).await
            }
        }
    }

    /// Deletes the object `name`; a missing one is no error.
    pub async fn delete(&self, name: &str) -> StreamResult<()> {
        let at = self.at(name)?;
        match &self.backend {
            Backend::S3(io) => match io.delete(&at).await {
                Err(e) if opendal_kind(&e) != Some(opendal::ErrorKind::NotFound) => {
                    Err(s3_error("deleting", &at, e))
                }
                _ => Ok(()),
            },
            Backend::Local(dir) => {
                let path = dir.join(name);
                blocking(move || match fs::remove_file(&path) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => Err(StreamError::Io {
                        action: "deleting",
                        path,
                        source: e,
                    }),
                    _ => Ok(()),
                })
                .await
            }
        }
    }

    /// `location/name`, once `name` is known to stay below the location.
    fn at(&self, name: &str) -> StreamResult<String> {
        let plain = !name.is_empty()
            && name
                .split('/')
                .all(|part| !part.is_empty() && part != "." && part != "..");
        if !plain {
            let system = match self.backend {
                Backend::S3(_) => "s3",
                Backend::Local(_) => "file",
            };
            return Err(StreamError::external(
                OPERATOR,
                system,
                format!("naming an object under {}", self.location),
                format!("{name:?} is not a relative object name"),
                false,
            ));
        }
        Ok(format!("{}/{name}", self.location))
    }
}

/// The kind of the OpenDAL error under an iceberg storage error, if any.
fn opendal_kind(e: &iceberg::Error) -> Option<opendal::ErrorKind> {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(e) = cause.downcast_ref::<opendal::Error>() {
            return Some(e.kind());
        }
        source = cause.source();
    }
    None
}

/// An S3 error as a [`StreamError`] naming the action and the object:
/// retryable unless the store refused the request for good.
fn s3_error(action: &str, at: &str, e: iceberg::Error) -> StreamError {
    use opendal::ErrorKind as K;
    let retryable = match opendal_kind(&e) {
        Some(kind) => !matches!(
            kind,
            K::PermissionDenied
                | K::ConfigInvalid
                | K::Unsupported
                | K::IsADirectory
                | K::NotADirectory
                | K::IsSameFile
                | K::RangeNotSatisfied
        ),
        // Not the store's answer: a path iceberg's storage would not take.
        None => e.retryable(),
    };
    StreamError::external(OPERATOR, "s3", format!("{action} {at}"), e, retryable)
}

/// Replaces `path` with `bytes` atomically and durably: a temporary file
/// beside it, synced, renamed over it, and the directory synced.
fn replace_synced(path: &Path, bytes: &[u8]) -> StreamResult<()> {
    let io_err = |action: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| StreamError::Io {
            action,
            path,
            source,
        }
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err("creating the directory", dir))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".tmp-{name}-{}", uuid::Uuid::new_v4().simple()));
    let written = fs::File::create(&tmp).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("writing", &tmp)(e));
    }
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("renaming into place", path)(e));
    }
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing the directory", dir))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> StreamResult<T> + Send + 'static,
) -> StreamResult<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        // Only a runtime shutting down cancels a blocking task.
        Err(join) => Err(StreamError::Io {
            action: "running a blocking file operation",
            path: PathBuf::new(),
            source: io::Error::other(join),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[tokio::test]
    async fn local_objects_are_replaced_whole_and_missing_ones_are_none() {
        let dir = tempfile::tempdir().unwrap();
        for location in [
            format!("file://{}/store/", dir.path().display()),
            format!("{}/store", dir.path().display()),
        ] {
            let files = ObjectFiles::open(&location, &HashMap::new()).unwrap();
            assert!(!files.location().ends_with('/'));
            assert_eq!(files.get("_index").await.unwrap(), None);
            files.put("_index", b"one".to_vec()).await.unwrap();
            files.put("_index", b"two".to_vec()).await.unwrap();
            files.put("aside/chk-1.ckpt", b"cp".to_vec()).await.unwrap();
            assert_eq!(files.get("_index").await.unwrap(), Some(b"two".to_vec()));
            assert_eq!(
                files.get("aside/chk-1.ckpt").await.unwrap(),
                Some(b"cp".to_vec())
            );
            files.delete("_index").await.unwrap();
            files.delete("_index").await.unwrap();
            assert_eq!(files.get("_index").await.unwrap(), None);
            files.delete("aside/chk-1.ckpt").await.unwrap();
        }
        let mut left: Vec<_> = fs::read_dir(dir.path().join("store"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["aside"], "no temporary files are left");
    }

    #[tokio::test]
    async fn bad_locations_and_names_are_refused_and_secrets_never_show() {
        for bad in ["s3://", "s3:///prefix", "gs://bucket/x", "/", "file:///"] {
            let e = ObjectFiles::open(bad, &HashMap::new()).unwrap_err();
            assert!(!e.is_retryable() && e.to_string().contains(bad), "{e}");
        }
        let files = ObjectFiles::open(
            "s3://bucket/prefix/",
            &props(&[
                ("s3.endpoint", "http://127.0.0.1:1"),
                ("s3.access-key-id", "AKIA-object-files-test"),
                ("s3.secret-access-key", "object-files-secret-value"),
            ]),
        )
        .unwrap();
        assert_eq!(files.location(), "s3://bucket/prefix");
        let debug = format!("{files:?}");
        assert!(
            debug.contains("http://127.0.0.1:1") && !debug.contains("object-files-secret-value"),
            "{debug}"
        );
        assert_eq!(
            secrets::scrub("x object-files-secret-value y"),
            "x *** y",
            "registered on open"
        );
        for name in ["", "/abs", "a//b", "../up", "a/./b"] {
            let e = files.get(name).await.unwrap_err();
            assert!(e.to_string().contains("not a relative object name"), "{e}");
        }
    }
}
