//! `LocalDirStore` against a real directory: round trips, what a crash or a
//! damaged disk leaves behind (stale temporary files, truncated, bit-flipped
//! and foreign files), retention, id continuity across restarts (also through
//! `CoordinatorDriver::start`), configuration errors and failing writes.
//!
//! Damage is done by hand to the files the store wrote, the way a torn write,
//! a bad sector or a stray copy would leave them; every test then checks what
//! `latest`, `highest_id` and `list` report and what is left on disk.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use tinyflow_api::{CheckpointId, JobId, StreamError, TaskId};
use tinyflow_checkpoint::CorruptReason;
use tinyflow_checkpoint::store::{decode, encode};
use tinyflow_checkpoint::{CheckpointConfig, CoordinatorDriver, DriverConfig, LocalDirStore};
use tinyflow_checkpoint::{CheckpointStore, CompletedCheckpoint, StateHandle, SystemWallClock};

/// Header bytes before the payload: magic, version, payload length, CRC-32.
const HEADER_LEN: usize = 8 + 4 + 8 + 4;

fn job(name: &str) -> JobId {
    JobId::new(name).expect("test job ids are valid")
}

fn cid(raw: u64) -> CheckpointId {
    CheckpointId::new(raw)
}

/// `len` bytes from a fixed-seed SplitMix64 stream: deterministic, and no
/// two seeds give the same bytes, so a mixed-up task state shows.
fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    tinyflow_tests::SplitMix64::new(seed).bytes(len)
}

fn checkpoint(
    job_id: &JobId,
    id: u64,
    states: impl IntoIterator<Item = (u32, StateHandle)>,
) -> CompletedCheckpoint {
    CompletedCheckpoint {
        job_id: job_id.clone(),
        id: cid(id),
        triggered_at_ms: 1_700_000_000_000 + id * 1_000,
        acked_at_ms: 1_700_000_000_000 + id * 1_000 + 250,
        is_final: false,
        task_states: states
            .into_iter()
            .map(|(task, state)| (TaskId::new(task), state))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// Three tasks whose small states name the task and the checkpoint.
fn small(job_id: &JobId, id: u64) -> CompletedCheckpoint {
    checkpoint(
        job_id,
        id,
        (0..3).map(|t| {
            (
                t,
                StateHandle::from(format!("task {t} at {id}").into_bytes()),
            )
        }),
    )
}

async fn persist_all(store: &LocalDirStore, checkpoints: &[CompletedCheckpoint]) -> Result<()> {
    for cp in checkpoints {
        store
            .persist(cp)
            .await
            .with_context(|| format!("persisting checkpoint {}", cp.id))?;
    }
    Ok(())
}

/// Names of everything in `dir`, sorted.
fn dir_names(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let name = entry?.file_name();
        let name = name.to_str().context("non UTF-8 file name")?;
        if name != tinyflow_checkpoint::LOCK_FILE {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

fn file_name(id: u64) -> String {
    format!("chk-{id:020}.ckpt")
}

async fn latest_id(store: &LocalDirStore) -> Result<Option<CheckpointId>> {
    Ok(store.latest().await?.map(|cp| cp.id))
}

async fn start_driver(
    store: &LocalDirStore,
    job_id: &JobId,
    sinks_committed: Option<u64>,
) -> Result<tinyflow_checkpoint::Restored> {
    let mut config = DriverConfig::new(job_id.clone(), CheckpointConfig::default());
    config.sinks_committed = sinks_committed.map(cid);
    let (_driver, _handle, restored) =
        CoordinatorDriver::start(config, Arc::new(store.clone()), Arc::new(SystemWallClock))
            .await
            .context("starting the coordinator driver")?;
    Ok(restored)
}

#[tokio::test]
async fn round_trip_keeps_every_task_state_of_a_one_megabyte_checkpoint() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("round-trip");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    assert_eq!(store.latest().await?, None);
    assert_eq!(store.highest_id().await?, None);

    let first = small(&job_id, 1);
    // Four 256 KiB states, one empty task and one tiny one: 1 MiB in total.
    let mut big = checkpoint(
        &job_id,
        2,
        (0..4u32)
            .map(|t| {
                (
                    t * 7,
                    StateHandle::from(pseudo_random(u64::from(t), 256 * 1024)),
                )
            })
            .chain([
                (100, StateHandle::empty()),
                (101, StateHandle::from(&b"x"[..])),
            ]),
    );
    big.is_final = true;
    assert_eq!(big.state_bytes(), 1024 * 1024 + 1);
    persist_all(&store, &[first.clone(), big.clone()]).await?;

    assert_eq!(store.latest().await?.as_ref(), Some(&big));
    assert_eq!(store.highest_id().await?, Some(cid(2)));
    assert_eq!(store.list().await?, vec![cid(1), cid(2)]);
    let on_disk = fs::metadata(store.path_of(cid(2)))?.len();
    assert!(
        on_disk > 1024 * 1024,
        "checkpoint 2 is only {on_disk} bytes"
    );
    assert_eq!(
        dir_names(tmp.path())?,
        vec![file_name(1), file_name(2)],
        "no temporary file may be left behind"
    );

    // A fresh instance reads the same bytes back.
    drop(store);
    let reopened = LocalDirStore::open(tmp.path(), job_id, 3).await?;
    let restored = reopened.latest().await?.context("nothing restored")?;
    assert_eq!(restored, big);
    for (task, state) in &big.task_states {
        assert_eq!(
            restored.task_states[task].as_bytes(),
            state.as_bytes(),
            "{task}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn stale_temp_files_are_removed_on_open_and_never_read() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("crash");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    let first = small(&job_id, 1);
    persist_all(&store, std::slice::from_ref(&first)).await?;

    // A crash after writing checkpoint 2 completely but before the rename,
    // and one halfway through writing checkpoint 3.
    let whole = encode(&small(&job_id, 2));
    let half = encode(&small(&job_id, 3));
    let tmp2 = tmp.path().join(format!(".tmp-chk-{:020}.ckpt", 2));
    let tmp3 = tmp.path().join(format!(".tmp-chk-{:020}.ckpt", 3));
    fs::write(&tmp2, &whole)?;
    fs::write(&tmp3, &half[..half.len() / 2])?;

    // Not a checkpoint even before the restart cleans it up.
    assert_eq!(store.list().await?, vec![cid(1)]);
    assert_eq!(store.latest().await?.as_ref(), Some(&first));
    assert_eq!(store.highest_id().await?, Some(cid(1)));
    drop(store);

    let reopened = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    assert_eq!(dir_names(tmp.path())?, vec![file_name(1)]);
    assert!(!tmp2.exists() && !tmp3.exists());
    assert_eq!(reopened.latest().await?.as_ref(), Some(&first));
    assert_eq!(reopened.highest_id().await?, Some(cid(1)));

    // The id is free again: nothing of the torn write was ever complete.
    let second = small(&job_id, 2);
    reopened.persist(&second).await?;
    assert_eq!(reopened.latest().await?, Some(second));
    Ok(())
}

#[tokio::test]
async fn truncated_newest_file_falls_back_to_the_previous_checkpoint() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("truncated");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    let first = small(&job_id, 1);
    persist_all(&store, &[first.clone(), small(&job_id, 2)]).await?;
    let newest = store.path_of(cid(2));
    let whole = fs::read(&newest)?;
    assert!(whole.len() > HEADER_LEN + 10);

    for cut in [
        0,
        5,
        HEADER_LEN - 1,
        HEADER_LEN,
        HEADER_LEN + 10,
        whole.len() / 2,
        whole.len() - 1,
    ] {
        fs::write(&newest, &whole[..cut])?;
        assert!(decode(&whole[..cut]).is_err(), "cut at {cut} decodes");
        assert_eq!(
            store.latest().await?.as_ref(),
            Some(&first),
            "cut at {cut} of {}",
            whole.len()
        );
        assert_eq!(store.highest_id().await?, Some(cid(2)), "cut at {cut}");
    }
    // The damaged file is skipped, not deleted: it is the only trace of id 2.
    assert_eq!(store.list().await?, vec![cid(1), cid(2)]);

    // Intact again, it is the newest again.
    fs::write(&newest, &whole)?;
    assert_eq!(latest_id(&store).await?, Some(cid(2)));
    Ok(())
}

#[tokio::test]
async fn flipped_payload_byte_falls_back_to_the_previous_checkpoint() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("bit-flip");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    let first = small(&job_id, 1);
    persist_all(&store, &[first.clone(), small(&job_id, 2)]).await?;
    let newest = store.path_of(cid(2));
    let whole = fs::read(&newest)?;

    // One byte of the last task's state: the length still matches, only the
    // checksum can tell.
    let mut flipped = whole.clone();
    let at = flipped.len() - 3;
    flipped[at] ^= 0x01;
    assert!(
        matches!(
            decode(&flipped),
            Err(CorruptReason::ChecksumMismatch { .. })
        ),
        "{:?}",
        decode(&flipped)
    );
    fs::write(&newest, &flipped)?;
    assert_eq!(fs::metadata(&newest)?.len(), whole.len() as u64);

    assert_eq!(store.latest().await?, Some(first));
    assert_eq!(store.highest_id().await?, Some(cid(2)));
    Ok(())
}

#[tokio::test]
async fn garbage_or_bad_magic_falls_back_to_the_previous_checkpoint() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("garbage");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 5).await?;
    let second = small(&job_id, 2);
    persist_all(&store, &[small(&job_id, 1), second.clone()]).await?;

    let mut bad_magic = encode(&small(&job_id, 3));
    bad_magic[0] = b'X';
    let mut wrong_version = encode(&small(&job_id, 3));
    wrong_version[8] = 9;
    let cases: [(&str, Vec<u8>); 4] = [
        ("random bytes", pseudo_random(42, 4096)),
        ("bad magic", bad_magic),
        ("unknown format version", wrong_version),
        ("empty file", Vec::new()),
    ];
    let path = tmp.path().join(file_name(3));
    for (what, bytes) in cases {
        fs::write(&path, &bytes)?;
        assert_eq!(
            store.latest().await?.as_ref(),
            Some(&second),
            "{what} in the newest file"
        );
        assert_eq!(store.highest_id().await?, Some(cid(3)), "{what}");
    }
    // A checkpoint's content under another id's name is refused as well.
    fs::write(&path, encode(&small(&job_id, 7)))?;
    assert_eq!(store.latest().await?.as_ref(), Some(&second));
    Ok(())
}

#[tokio::test]
async fn all_files_corrupt_restore_nothing_but_ids_continue() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("all-corrupt");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    persist_all(
        &store,
        &(1..=3).map(|id| small(&job_id, id)).collect::<Vec<_>>(),
    )
    .await?;

    let one = store.path_of(cid(1));
    let bytes = fs::read(&one)?;
    fs::write(&one, &bytes[..bytes.len() - 4])?;
    let two = store.path_of(cid(2));
    let mut bytes = fs::read(&two)?;
    bytes[HEADER_LEN + 1] ^= 0x80;
    fs::write(&two, &bytes)?;
    fs::write(store.path_of(cid(3)), pseudo_random(3, 100))?;
    drop(store);

    let reopened = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    assert_eq!(reopened.latest().await?, None);
    assert_eq!(reopened.highest_id().await?, Some(cid(3)));
    assert_eq!(reopened.list().await?, vec![cid(1), cid(2), cid(3)]);

    let restored = start_driver(&reopened, &job_id, None).await?;
    assert_eq!(restored.checkpoint, None);
    assert_eq!(restored.next_id, cid(4), "ids must not be reused");

    let fourth = small(&job_id, 4);
    reopened.persist(&fourth).await?;
    assert_eq!(reopened.latest().await?, Some(fourth));
    Ok(())
}

#[tokio::test]
async fn retention_keeps_only_the_newest_three() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("retention");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    for id in 1..=10u64 {
        store.persist(&small(&job_id, id)).await?;
        let kept: Vec<_> = (id.saturating_sub(2).max(1)..=id).map(cid).collect();
        assert_eq!(store.list().await?, kept, "after persisting {id}");
    }
    assert_eq!(store.list().await?, vec![cid(8), cid(9), cid(10)]);
    assert_eq!(
        dir_names(tmp.path())?,
        vec![file_name(8), file_name(9), file_name(10)]
    );
    assert_eq!(store.latest().await?, Some(small(&job_id, 10)));
    assert_eq!(store.highest_id().await?, Some(cid(10)));
    Ok(())
}

#[tokio::test]
async fn ids_continue_across_a_restart_and_above_what_sinks_committed() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("restart");
    let store = LocalDirStore::open(tmp.path(), job_id.clone(), 10).await?;
    persist_all(
        &store,
        &(1..=5).map(|id| small(&job_id, id)).collect::<Vec<_>>(),
    )
    .await?;
    drop(store);

    let reopened = LocalDirStore::open(tmp.path(), job_id.clone(), 10).await?;
    assert_eq!(reopened.highest_id().await?, Some(cid(5)));
    assert_eq!(reopened.latest().await?, Some(small(&job_id, 5)));

    let restored = start_driver(&reopened, &job_id, None).await?;
    assert_eq!(restored.checkpoint, Some(small(&job_id, 5)));
    assert_eq!(restored.next_id, cid(6));

    // A sink committed as far as the store remembers: ids go on above both.
    let restored = start_driver(&reopened, &job_id, Some(5)).await?;
    assert_eq!(restored.next_id, cid(6));

    // A sink committed further than the store remembers (the store lost its
    // newest files): restoring checkpoint 5 would replay records the sink
    // committed under 6..=9, so the start is refused, naming both ids.
    let err = start_driver(&reopened, &job_id, Some(9)).await.unwrap_err();
    let err = err.downcast::<tinyflow_checkpoint::Error>()?;
    assert!(
        matches!(err, tinyflow_checkpoint::Error::RestoreBehindSinks { restored, committed }
            if restored == cid(5) && committed == cid(9)),
        "{err}"
    );
    assert!(!err.is_retryable());

    // A wiped store cannot make ids the sink committed look new either.
    let wiped = LocalDirStore::open(tmp.path().join("wiped"), job_id.clone(), 10).await?;
    let restored = start_driver(&wiped, &job_id, Some(9)).await?;
    assert_eq!(restored.checkpoint, None);
    assert_eq!(restored.next_id, cid(10));
    let restored = start_driver(&wiped, &job_id, None).await?;
    assert_eq!(restored.next_id, CheckpointId::FIRST);
    Ok(())
}

#[tokio::test]
async fn directory_of_another_job_is_refused_naming_both_jobs() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let alpha = job("job-alpha");
    let store = LocalDirStore::open(tmp.path(), alpha.clone(), 3).await?;
    store.persist(&small(&alpha, 1)).await?;
    drop(store);

    let beta = LocalDirStore::open(tmp.path(), job("job-beta"), 3).await?;
    let err = match beta.latest().await {
        Ok(found) => bail!("job-beta read job-alpha's checkpoint: {found:?}"),
        Err(e) => e,
    };
    let message = err.to_string();
    assert!(
        matches!(
            err,
            StreamError::Config {
                key: "checkpoint.dir",
                ..
            }
        ),
        "{err:?}"
    );
    for needle in ["checkpoint.dir", "job-alpha", "job-beta"] {
        assert!(message.contains(needle), "{needle:?} missing in: {message}");
    }
    assert!(!err.is_retryable());
    Ok(())
}

#[tokio::test]
async fn retain_zero_is_rejected_naming_the_key() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("never-created");
    let err = match LocalDirStore::open(&dir, job("retain"), 0).await {
        Ok(store) => bail!("retain=0 accepted: {store:?}"),
        Err(e) => e,
    };
    assert!(
        matches!(
            err,
            StreamError::Config {
                key: "checkpoint.retain",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("checkpoint.retain"), "{err}");
    assert!(!err.is_retryable());
    assert!(!dir.exists(), "a rejected config must not touch the disk");
    Ok(())
}

#[tokio::test]
async fn failed_write_is_retryable_names_the_path_and_keeps_the_previous() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("checkpoints");
    let aside = tmp.path().join("checkpoints-aside");
    let job_id = job("unwritable");
    let store = LocalDirStore::open(&dir, job_id.clone(), 3).await?;
    let first = small(&job_id, 1);
    store.persist(&first).await?;

    // The directory goes away under the store and a regular file takes its
    // place (an unmounted volume, an operator's mistake). Permission bits
    // would not stop root; this fails for every user.
    fs::rename(&dir, &aside)?;
    fs::write(&dir, b"not a directory")?;
    let err = match store.persist(&small(&job_id, 2)).await {
        Ok(()) => bail!("persist into a regular file succeeded"),
        Err(e) => e,
    };
    let StreamError::Io { path, source, .. } = &err else {
        bail!("expected an i/o error, got {err:?}");
    };
    ensure!(
        path.starts_with(&dir),
        "{} not under {}",
        path.display(),
        dir.display()
    );
    assert_eq!(source.kind(), io::ErrorKind::NotADirectory, "{source}");
    assert!(
        err.to_string().contains(&*dir.to_string_lossy()),
        "path missing in: {err}"
    );
    assert!(err.is_retryable());

    // Nothing of checkpoint 2 reached the real directory.
    assert_eq!(dir_names(&aside)?, vec![file_name(1)]);
    fs::remove_file(&dir)?;
    fs::rename(&aside, &dir)?;
    assert_eq!(store.latest().await?.as_ref(), Some(&first));
    assert_eq!(store.highest_id().await?, Some(cid(1)));

    // Retrying once the directory is back succeeds.
    let second = small(&job_id, 2);
    store.persist(&second).await?;
    assert_eq!(store.latest().await?, Some(second));
    assert_eq!(dir_names(&dir)?, vec![file_name(1), file_name(2)]);
    Ok(())
}

#[tokio::test]
async fn persist_of_another_jobs_checkpoint_is_rejected() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = LocalDirStore::open(tmp.path(), job("job-alpha"), 3).await?;
    let err = match store.persist(&small(&job("job-beta"), 1)).await {
        Ok(()) => bail!("job-alpha's store accepted job-beta's checkpoint"),
        Err(e) => e,
    };
    assert!(
        matches!(
            err,
            StreamError::Config {
                key: "checkpoint.dir",
                ..
            }
        ),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("job-alpha") && message.contains("job-beta"),
        "{message}"
    );
    assert!(!err.is_retryable());
    assert_eq!(dir_names(tmp.path())?, Vec::<String>::new());
    assert_eq!(store.latest().await?, None);
    assert_eq!(store.highest_id().await?, None);
    Ok(())
}

/// One directory, one run: a second store on the directory is turned away
/// for good (not retryable, so a runner does not restart into it), naming
/// who holds it; once the first is gone the directory opens again.
#[tokio::test]
async fn a_second_run_on_the_same_directory_is_turned_away_naming_the_holder() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let job_id = job("locked");
    assert_eq!(LocalDirStore::holder(tmp.path())?, None);
    let first = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    let holder = LocalDirStore::holder(tmp.path())?.context("no holder while open")?;
    ensure!(
        holder.contains(&format!("pid {}", std::process::id())),
        "{holder}"
    );
    let Err(err) = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await else {
        bail!("a second store opened the locked directory");
    };
    ensure!(matches!(err, StreamError::Fenced { .. }), "{err:?}");
    ensure!(!err.is_retryable(), "{err}");
    let text = err.to_string();
    ensure!(
        text.contains("in use by another run") && text.contains(&holder),
        "{text}"
    );
    drop(first);
    assert_eq!(LocalDirStore::holder(tmp.path())?, None);
    let again = LocalDirStore::open(tmp.path(), job_id.clone(), 3).await?;
    again.persist(&small(&job_id, 1)).await?;
    Ok(())
}
