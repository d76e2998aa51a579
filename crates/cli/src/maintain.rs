//! Table upkeep from the job file: `[sink.maintenance]` planned into the
//! sink's [`Maintenance`] policy (which the job's committer runs after its
//! commits), and `tinyflow maintain JOB.toml`, one round of that policy on
//! the job's table for tables no job maintains (the job is gone, or runs
//! with `enabled = false`). A round commits through the catalog's
//! optimistic concurrency, so it is safe beside a running job.

use std::time::Duration;

use tinyflow_connectors_iceberg::{IcebergSink, IcebergSinkConfig, Maintenance};

use crate::jobfile::{CountOrOff, MaintenanceSection};
use crate::plan::Placement;
use crate::{JobFile, JobFileError, format_duration, parse_duration};

/// `off` or a duration, read for `key`.
fn off_or_duration(key: &str, text: &str) -> Result<Option<Duration>, JobFileError> {
    if text.trim() == "off" {
        return Ok(None);
    }
    parse_duration(text)
        .map(Some)
        .map_err(|m| JobFileError::new(key, format!("{m}, or off")))
}

/// `off` or a count of at least 1, read for `key`.
fn off_or_count(key: &str, value: &CountOrOff) -> Result<Option<usize>, JobFileError> {
    match value {
        CountOrOff::Count(0) => Err(JobFileError::new(
            key,
            "0: expected at least 1 (the current metadata file is always kept besides), or off",
        )),
        CountOrOff::Count(n) => Ok(Some(*n)),
        CountOrOff::Word(w) if w.trim() == "off" => Ok(None),
        CountOrOff::Word(w) => Err(JobFileError::new(
            key,
            format!("`{w}`: expected a count of at least 1, or off"),
        )),
    }
}

/// The policy `[sink.maintenance]` describes, with [`Maintenance::default`]
/// for what it leaves out. `enabled` aside: it decides whether the job runs
/// the policy, not what the policy is.
pub fn policy(section: &MaintenanceSection) -> Result<Maintenance, JobFileError> {
    let defaults = Maintenance::default();
    let expire_older_than = match section.expire_older_than.as_deref() {
        None => defaults.expire_older_than,
        Some(text) => off_or_duration("sink.maintenance.expire_older_than", text)?,
    };
    let metadata_versions_max = match &section.metadata_versions_max {
        None => defaults.metadata_versions_max,
        Some(v) => off_or_count("sink.maintenance.metadata_versions_max", v)?,
    };
    let retain_last = section.retain_last.unwrap_or(defaults.retain_last);
    if retain_last == 0 {
        return Err(JobFileError::new(
            "sink.maintenance.retain_last",
            "0: expected at least 1 (the current snapshot is always kept)",
        ));
    }
    let every = match section.every.as_deref() {
        None => defaults.every,
        Some(text) => {
            parse_duration(text).map_err(|m| JobFileError::new("sink.maintenance.every", m))?
        }
    };
    Ok(Maintenance {
        expire_older_than,
        retain_last,
        metadata_versions_max,
        every,
    })
}

/// What the job's sink runs: the policy, unless `enabled = false`, or the
/// job runs as a worker other than worker 0 (maintenance is per table, and
/// worker 0 of the layout runs it for all of them). The section is checked
/// either way: a typo in it is an error even when it is off.
pub(crate) fn in_job(
    section: &MaintenanceSection,
    placement: Option<&Placement>,
) -> Result<Option<Maintenance>, JobFileError> {
    let policy = policy(section)?;
    if section.enabled == Some(false) || placement.is_some_and(|p| p.worker.index() != 0) {
        return Ok(None);
    }
    Ok(Some(policy))
}

/// What `tinyflow maintain` takes from its command line over the job
/// file's `[sink.maintenance]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--older-than`: a duration or `off`.
    pub older_than: Option<String>,
    /// `--retain-last`.
    pub retain_last: Option<usize>,
    /// `--metadata-versions-max`: a count or `off`.
    pub metadata_versions_max: Option<String>,
    /// `--dry-run`: change nothing, say what would go.
    pub dry_run: bool,
}

/// The outcome of `tinyflow maintain`: what to print, and what the round
/// could not do (which makes the command fail, after printing).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Maintained {
    /// Lines for standard output.
    pub lines: Vec<String>,
    /// What the round could not do; nothing referenced was deleted.
    pub problems: Vec<String>,
}

/// The job file's policy with the command line's overrides.
pub fn with_overrides(
    section: &MaintenanceSection,
    overrides: &Overrides,
) -> Result<Maintenance, JobFileError> {
    let mut policy = policy(section)?;
    if let Some(text) = &overrides.older_than {
        policy.expire_older_than = off_or_duration("--older-than", text)?;
    }
    if let Some(n) = overrides.retain_last {
        if n == 0 {
            return Err(JobFileError::new(
                "--retain-last",
                "0: expected at least 1 (the current snapshot is always kept)",
            ));
        }
        policy.retain_last = n;
    }
    if let Some(text) = &overrides.metadata_versions_max {
        let value = match text.trim().parse::<usize>() {
            Ok(n) => CountOrOff::Count(n),
            Err(_) => CountOrOff::Word(text.clone()),
        };
        policy.metadata_versions_max = off_or_count("--metadata-versions-max", &value)?;
    }
    Ok(policy)
}

/// The policy in words.
fn describe(policy: &Maintenance) -> String {
    let snapshots = match policy.expire_older_than {
        Some(age) => format!(
            "expire snapshots older than {} keeping at least {}",
            format_duration(age),
            policy.retain_last
        ),
        None => "no snapshot expires".to_owned(),
    };
    let metadata = match policy.metadata_versions_max {
        Some(n) => format!("keep {n} previous metadata files"),
        None => "metadata files left alone".to_owned(),
    };
    format!("{snapshots}; {metadata}")
}

/// `tinyflow maintain JOB.toml`: one round of the job file's maintenance
/// policy (with `overrides`) on the job's table, which must exist. Needs
/// only the `[sink]` section to be reachable: the source is not contacted
/// and the schema not resolved. Maintenance is per table, so a job spread
/// over workers is maintained once, whatever its layout.
pub async fn maintain(file: &JobFile, overrides: &Overrides) -> anyhow::Result<Maintained> {
    let k = &file.sink;
    let policy = with_overrides(&k.maintenance, overrides)?;
    let sink_id = k.sink_id.clone().unwrap_or_else(|| file.job.name.clone());
    let catalog = crate::plan::catalog(&k.catalog)?;
    let described = catalog.describe();
    let config = IcebergSinkConfig::new(catalog, &k.namespace, &k.table, &sink_id);
    let sink = IcebergSink::new(config).map_err(|e| match e {
        tinyflow_api::StreamError::Config { key, message } => {
            anyhow::Error::new(JobFileError::new(key, message))
        }
        other => anyhow::Error::new(other),
    })?;
    let report = sink.maintain(&policy, overrides.dry_run).await?;
    let mut lines = Vec::new();
    if report.dry_run {
        lines.push("dry run: nothing was changed".to_owned());
    }
    lines.push(format!(
        "table {}.{} ({described}): {}",
        k.namespace,
        k.table,
        report.summary()
    ));
    lines.push(format!("policy: {}", describe(&policy)));
    if report.dry_run {
        lines.extend(report.files.iter().map(|f| format!("would delete {f}")));
    }
    Ok(Maintained {
        lines,
        problems: report.problems,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn section(toml_text: &str) -> MaintenanceSection {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn the_section_defaults_to_the_sinks_defaults_and_takes_off() {
        assert_eq!(policy(&section("")).unwrap(), Maintenance::default());
        let p = policy(&section(
            "expire_older_than = \"off\"\nretain_last = 3\nmetadata_versions_max = \"off\"\nevery = \"10s\"",
        ))
        .unwrap();
        assert_eq!(
            p,
            Maintenance {
                expire_older_than: None,
                retain_last: 3,
                metadata_versions_max: None,
                every: Duration::from_secs(10),
            }
        );
        let p = policy(&section(
            "expire_older_than = \"2h\"\nmetadata_versions_max = 5",
        ))
        .unwrap();
        assert_eq!(p.expire_older_than, Some(Duration::from_secs(7200)));
        assert_eq!(p.metadata_versions_max, Some(5));
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            (
                "expire_older_than = \"soon\"",
                "sink.maintenance.expire_older_than",
            ),
            ("retain_last = 0", "sink.maintenance.retain_last"),
            (
                "metadata_versions_max = 0",
                "sink.maintenance.metadata_versions_max",
            ),
            (
                "metadata_versions_max = \"all\"",
                "sink.maintenance.metadata_versions_max",
            ),
            ("every = \"5\"", "sink.maintenance.every"),
        ] {
            let err = policy(&section(text)).unwrap_err();
            assert_eq!(err.key, key, "{text}: {err}");
        }
        let err = toml::from_str::<MaintenanceSection>("retain = 3").unwrap_err();
        assert!(err.to_string().contains("unknown field `retain`"), "{err}");
    }

    #[test]
    fn the_command_line_overrides_the_file() {
        let file = section("expire_older_than = \"1h\"\nretain_last = 7");
        let p = with_overrides(
            &file,
            &Overrides {
                older_than: Some("0s".to_owned()),
                retain_last: Some(2),
                metadata_versions_max: Some("off".to_owned()),
                dry_run: true,
            },
        )
        .unwrap();
        assert_eq!(p.expire_older_than, Some(Duration::ZERO));
        assert_eq!(p.retain_last, 2);
        assert_eq!(p.metadata_versions_max, None);
        for (o, key) in [
            (
                Overrides {
                    older_than: Some("1 day".to_owned()),
                    ..Overrides::default()
                },
                "--older-than",
            ),
            (
                Overrides {
                    retain_last: Some(0),
                    ..Overrides::default()
                },
                "--retain-last",
            ),
            (
                Overrides {
                    metadata_versions_max: Some("many".to_owned()),
                    ..Overrides::default()
                },
                "--metadata-versions-max",
            ),
        ] {
            assert_eq!(with_overrides(&file, &o).unwrap_err().key, key);
        }
    }

    #[test]
    fn only_worker_0_of_a_layout_runs_it_in_the_job_and_enabled_false_turns_it_off() {
        let on = section("");
        assert!(in_job(&on, None).unwrap().is_some());
        assert!(in_job(&section("enabled = false"), None).unwrap().is_none());
        // Checked even when off.
        assert!(in_job(&section("enabled = false\nretain_last = 0"), None).is_err());
        let layout = tinyflow_connectors_iceberg::Layout {
            generation: 1,
            workers: 2,
        };
        let placement = |i: u32| Placement {
            worker: format!("{i}/2").parse().unwrap(),
            layout,
            base_sink: "s".to_owned(),
            sink_id: layout.sink_id("s", i),
        };
        assert!(in_job(&on, Some(&placement(0))).unwrap().is_some());
        assert!(in_job(&on, Some(&placement(1))).unwrap().is_none());
    }
}
